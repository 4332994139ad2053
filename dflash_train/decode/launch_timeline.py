"""Where the GPU's time goes over a generation job, measured on the GPU's own clock.

The engine's host clock (`graphed_engine.Timings`) says how long the host waited for the GPU, not
whether the GPU waited for the host. So every launch (a chunk of steps, a prefill) goes between two
device marks: the GPU's time then splits into each kind's share and the gaps between launches,
where the GPU had nothing queued. Two event records a launch, no synchronisation: a mark is read
once the GPU has passed it (the engine reads a chunk only after its event, so every mark recorded
before it has passed by then). A profiler window over the whole job ran past its time limit twice
on an H200 without a result; these marks cost microseconds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dflash_train.device_clock import DeviceClock

LONG_GAP_MS = 0.5
"""A gap this long is the host falling behind, not the few microseconds between two launches."""


@dataclass
class Span:
    kind: str
    start_ms: float
    """From the job's first mark, on the GPU's clock."""
    end_ms: float


class LaunchTimeline:
    """Launches between device marks (`around`), read as the GPU passes them (`settle`) into spans on
    the GPU's clock; `summary` splits a stretch of them into busy time per kind and idle gaps. On CPU
    the host's clock stands in: the bookkeeping runs, the figures mean nothing."""

    def __init__(self, device):
        self.clock = DeviceClock(device)
        self.origin = None
        self.pending: deque[tuple[str, object, object]] = deque()
        self.spans: list[Span] = []

    def around(self, kind: str, launch, *args):
        """`launch(*args)` between two marks; returns what it returns."""
        start = self.clock.mark()
        if self.origin is None:
            self.origin = start
        out = launch(*args)
        self.pending.append((kind, start, self.clock.mark()))
        return out

    def settle(self) -> None:
        """Reads every mark the GPU has passed, oldest first (never blocks)."""
        while self.pending and self.clock.passed(self.pending[0][2]):
            kind, start, end = self.pending.popleft()
            ms = lambda mark: 1e3 * self.clock.seconds(self.origin, mark)  # noqa: E731
            self.spans.append(Span(kind, ms(start), ms(end)))

    def summary(self, spans: list[Span] | None = None) -> dict:
        """Over `spans` (default: all read): the span from first start to last end, each kind's
        launches and busy milliseconds, and the idle milliseconds between launches (all of them,
        and those in gaps of LONG_GAP_MS or more)."""
        spans = self.spans if spans is None else spans
        if not spans:
            return {}
        out: dict = {"span_ms": round(spans[-1].end_ms - spans[0].start_ms, 1)}
        for kind in sorted({s.kind for s in spans}):
            mine = [s for s in spans if s.kind == kind]
            out[kind] = {"launches": len(mine), "busy_ms": round(sum(s.end_ms - s.start_ms for s in mine), 1)}
        gaps = [max(0.0, b.start_ms - a.end_ms) for a, b in zip(spans, spans[1:])]
        long = [g for g in gaps if g >= LONG_GAP_MS]
        out.update(idle_ms=round(sum(gaps), 1), long_gaps=len(long), idle_in_long_gaps_ms=round(sum(long), 1))
        out["idle_fraction"] = round(sum(gaps) / out["span_ms"], 4) if out["span_ms"] else None
        return out

    def __str__(self) -> str:
        s = self.summary()
        if not s:
            return "no launches"
        kinds = ", ".join(f"{kind} {v['busy_ms'] / 1e3:.1f} s ({v['launches']})" for kind, v in s.items()
                          if isinstance(v, dict))
        return (f"over {s['span_ms'] / 1e3:.1f} s: {kinds}; idle {s['idle_ms'] / 1e3:.1f} s "
                f"({s['idle_in_long_gaps_ms'] / 1e3:.1f} s in {s['long_gaps']} gaps of >= {LONG_GAP_MS} ms)")
