"""Where a step's time goes: torch.profiler over a few steps, summed by kernel family.

The question it answers first is whether the device or the host sets the pace. A small drafter's
step on an H200 has ~25-30 ms that do not grow with the batch (docs/benchmarks/throughput.md);
if the GPU sits idle between kernels for that long, fewer launches (CUDA graphs, a whole compiled
step) are the lever, and if it is busy, the kernels are. So the summary gives the wall time of a
step, the union of its kernels' intervals (device busy), the idle rest, the kernel launches and
host syncs per step, and the device time by kernel family. On a CPU there are no kernels: the
families are the ATen ops' own CPU time.
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable

import torch

from dflash_train.atomic import write_json_atomic

log = logging.getLogger("dflash_train")

FAMILIES = [  # first match wins; names are the kernels' own (cuBLAS, flash/flex, triton, ATen)
    ("matmul", r"gemm|matmul|cutlass|sm90_xmma|nvjet|_mm_|addmm|bmm|aten::mm\b"),
    ("attention", r"flash|flex|attention|fmha|sdpa|efficient_attention"),
    ("softmax / cross-entropy", r"softmax|cross_entropy|nll_loss|logsumexp"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("norms", r"norm|rsqrt"),
    ("copies / gathers / indexing", r"copy|gather|scatter|index|cat_|memcpy|memset|fill"),
    ("reductions", r"reduce|sum_|argmax|max_"),
]
TOP_KERNELS = 60
"""Kernels a summary names, costliest first: enough that two drafting families' steps can be told apart
kernel by kernel, past the ~25 that both share."""
LAUNCH = re.compile(r"^(cudaLaunch|cuLaunch|cudaGraphLaunch)")
SYNC = re.compile(r"Synchronize$")
STEP = re.compile(r"^(train|bench)_step_\d+$")
"""The record_function range of each profiled step: host syncs are counted inside them, not the
harness's own at the window's end (its synchronize, then the profiler's at exit)."""


def family(name: str) -> str:
    lowered = name.lower()
    return next((f for f, pattern in FAMILIES if re.search(pattern, lowered)), "elementwise / other")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: overlapping kernels (several streams) count once."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _is_device(event) -> bool:
    """A kernel, copy or memset on the device. Each record_function range (the steps' own, and
    torch.compile's regions) also appears on the device as a user annotation spanning its kernels
    and the gaps between them: not work."""
    return event.device_type != torch.autograd.DeviceType.CPU and not getattr(event, "is_user_annotation", False)


def _in_steps(events) -> Callable[[object], bool]:
    """Whether a host event starts inside one of the window's step ranges (`STEP`)."""
    ranges = [(e.time_range.start, e.time_range.end) for e in events
              if STEP.match(e.name) and e.device_type == torch.autograd.DeviceType.CPU]
    return lambda e: any(start <= e.time_range.start <= end for start, end in ranges)


def summarize(prof: torch.profiler.profile, steps: int, wall_s: float, device: torch.device) -> dict:
    """Per-step figures of a profiled window of `steps` steps (each a `STEP` range) that took `wall_s`."""
    events = prof.events()
    in_steps = _in_steps(events)
    on_device = [e for e in events if _is_device(e)]
    kernels = on_device if device.type != "cpu" else [e for e in events if e.key.startswith("aten::")]
    by_family: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for e in kernels:
        own = e.self_device_time_total if _is_device(e) else e.self_cpu_time_total
        by_family[family(e.key)] += own / 1e3 / steps
        by_name[e.key[:90]] += own / 1e3 / steps
    wall_ms = wall_s * 1e3 / steps
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in on_device]) / 1e3 / steps if on_device else None
    per_step = lambda n: round(n / steps, 2)  # noqa: E731
    return {
        "device": device.type,
        "steps": steps,
        "wall_ms": round(wall_ms, 3),
        "device_busy_ms": None if busy is None else round(busy, 3),
        "device_idle_ms": None if busy is None else round(wall_ms - busy, 3),
        "launches": per_step(sum(1 for e in events if LAUNCH.match(e.name))),
        "host_syncs": per_step(sum(1 for e in events if SYNC.search(e.name) and in_steps(e))),
        "families_ms": {k: round(v, 3) for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
        "top_ms": [[round(ms, 3), name] for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]],
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_callable(fn, device: torch.device, steps: int = 3) -> dict:
    """`summarize` of `steps` calls of `fn` (the benchmarks' end-to-end step)."""
    _sync(device)
    with _profiler(device) as prof:
        t = time.perf_counter()
        for i in range(steps):
            with torch.profiler.record_function(f"bench_step_{i}"):
                fn()
        _sync(device)
        wall = time.perf_counter() - t
    return summarize(prof, steps, wall, device)


def _profiler(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def extras_after(cfg) -> Callable[[int], bool]:
    """Whether the loop does more than step after completed step `s`: log (with its host syncs),
    checkpoint, evaluate or probe. A profiled window keeps clear of those."""
    tc, ec = cfg.train, cfg.eval
    every = [tc.log_every, cfg.checkpoint.every, ec.every, ec.heldout_every if ec.heldout_files else 0]
    return lambda s: any(n and s % n == 0 for n in every)


class StepProfiler:
    """`train.profile_at_step`: records `steps` consecutive optimizer steps from the first step at
    or after it whose window has no logging, checkpoint or evaluation inside, then writes
    <run_dir>/profile/step_<first>/summary.json and a Chrome trace (trace.json.gz, for Perfetto)."""

    SEARCH = 100_000  # steps looked ahead for a quiet window before giving up and noting the extras

    def __init__(self, at_step: int | None, run_dir: Path, device: torch.device,
                 extras: Callable[[int], bool] = lambda s: False, steps: int = 5):
        self.at, self.steps, self.device, self.extras = at_step, steps, device, extras
        self.run_dir = Path(run_dir)
        self.first: int | None = None  # the window's first step, once the run reaches profile_at_step
        self.notes: list[str] = []
        self.recorded = 0
        self.done = False
        self._prof = None
        self._t0 = 0.0
        self._pending = None

    def _quiet_start(self, step: int) -> int:
        for first in range(step, step + self.SEARCH):
            if not any(self.extras(s) for s in range(first, first + self.steps - 1)):
                if first != self.at:
                    self.notes.append(f"starts at step {first}, the first at or after {self.at} "
                                      "with no logging, checkpoint or evaluation inside the window")
                return first
        self.notes.append("logging, checkpoints or evaluations ran inside the window")
        return step

    def step(self, done: int):
        """Context for the optimizer step after `done` completed ones (it becomes step done + 1)."""
        if self.at is None or self.done or done + 1 < self.at:
            return nullcontext()
        if self.first is None:
            self.first = self._quiet_start(done + 1)
        return self._recording(done + 1) if done + 1 >= self.first else nullcontext()

    @contextmanager
    def _recording(self, step: int):
        if self._prof is None:
            _sync(self.device)
            self._prof = _profiler(self.device).__enter__()
            self._t0 = time.perf_counter()
        with torch.profiler.record_function(f"train_step_{step}"):
            yield
        self.recorded += 1
        if self.recorded == self.steps:
            self._stop()

    def abort(self) -> None:
        """A failed run: stop recording, write nothing."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof, self.done = None, True

    def _stop(self) -> None:
        _sync(self.device)
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        self._pending, self._prof, self.done = (self._prof, wall), None, True

    def flush(self) -> None:
        """Writes a finished window's files; the loop calls it outside the steps' timing."""
        if self._pending is not None:
            self._write(*self._pending)
            self._pending = None

    def close(self, last_step: int) -> None:
        """A run that ends inside the window still writes what it recorded; one that never got
        there says so."""
        if self._prof is not None:
            self.notes.append(f"the run ended after {self.recorded} of {self.steps} profiled steps")
            self._stop()
        elif self.at is not None and not self.done:
            log.warning("train.profile_at_step=%d: the run ended at step %d, before it; nothing was profiled",
                        self.at, last_step)
        self.flush()

    def _write(self, prof, wall: float) -> None:
        summary = summarize(prof, max(self.recorded, 1), wall, self.device)
        summary = {"first_step": self.first, **summary, "notes": self.notes}
        out = self.run_dir / "profile" / f"step_{self.first:08d}"
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / "trace.json.gz"))
        write_json_atomic(out / "summary.json", summary)
        idle = "" if summary["device_idle_ms"] is None else f", device idle {summary['device_idle_ms']:.1f} ms"
        log.info("profiled steps %d-%d: %.1f ms a step%s, %.0f launches, %.0f host syncs a step (%s)",
                 self.first, self.first + self.recorded - 1, summary["wall_ms"], idle, summary["launches"],
                 summary["host_syncs"], out / "summary.json")
