"""The GPU's clock over a generation job: launches between marks, read only once passed, summed
into busy time per kind and idle gaps (against sums worked by hand), and the engine marking every
launch it makes."""

from __future__ import annotations

import pytest
import torch

from dflash_train.decode.graphed_engine import GraphedEngine, Job
from dflash_train.decode.launch_timeline import LaunchTimeline, Span
from tests.decode.test_graphed_engine import backend, prompts_of, serve_all  # noqa: F401  (backend: a fixture)


class ScriptedClock:
    """Marks at the times given, in order; a mark counts as passed once `now` reaches it."""

    def __init__(self, times: list[float]):
        self.times, self.now = iter(times), 0.0

    def mark(self):
        return next(self.times)

    def passed(self, mark) -> bool:
        return mark <= self.now

    def seconds(self, a, b) -> float:
        return b - a


def test_summary_splits_busy_time_per_kind_and_idle_gaps():
    timeline = LaunchTimeline(torch.device("cpu"))
    timeline.spans = [Span("steps", 0.0, 10.0), Span("prefills", 10.2, 12.0), Span("steps", 15.0, 20.0)]
    s = timeline.summary()
    assert s["span_ms"] == 20.0
    assert s["steps"] == {"launches": 2, "busy_ms": 15.0} and s["prefills"] == {"launches": 1, "busy_ms": 1.8}
    assert s["idle_ms"] == pytest.approx(3.2) and s["long_gaps"] == 1 and s["idle_in_long_gaps_ms"] == 3.0
    assert s["idle_fraction"] == pytest.approx(0.16)
    assert timeline.summary([]) == {} and "no launches" in str(LaunchTimeline(torch.device("cpu")))


def test_settle_reads_only_the_marks_the_device_has_passed():
    timeline = LaunchTimeline(torch.device("cpu"))
    timeline.clock = ScriptedClock([1.0, 2.0, 2.5, 4.0, 5.0, 9.0])
    for kind in ("steps", "prefills", "steps"):
        assert timeline.around(kind, lambda x: x + 1, 41) == 42
    timeline.clock.now = 4.5  # the second launch's end (4.0) passed, the third's (9.0) not yet
    timeline.settle()
    assert [(s.kind, s.start_ms, s.end_ms) for s in timeline.spans] == [("steps", 0.0, 1000.0),
                                                                         ("prefills", 1500.0, 3000.0)]
    timeline.clock.now = 9.0
    timeline.settle()
    assert len(timeline.spans) == 3 and timeline.spans[-1].end_ms == 8000.0 and not timeline.pending


def test_the_engine_marks_every_launch(backend):  # noqa: F811
    """Each chunk of steps and each prefill is one span, in launch order, none overlapping."""
    prompts = prompts_of(backend, 3)
    jobs = [Job(p * k, 5) for p in prompts for k in (1, 9)]
    engine = GraphedEngine(backend.model, rows=2, stops=set(), pad_id=0, chunk=2)
    serve_all(engine, jobs)
    spans = engine.timeline.spans
    kinds = [s.kind for s in spans]
    assert kinds.count("steps") == engine.timings.chunks and kinds.count("prefills") == engine.timings.prefills
    assert all(a.end_ms <= b.start_ms for a, b in zip(spans, spans[1:])) and not engine.timeline.pending
    assert kinds[0] == "prefills"  # nothing runs before the first admission
