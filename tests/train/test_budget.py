"""The time budget: the run's steps shrink to what fits and its cosine schedule still ends on time."""

from __future__ import annotations

import math

import pytest

from dflash_train.train.budget import RESERVE, TimeBudget
from dflash_train.train.loop import Trainer
from dflash_train.train.metrics import read_metrics
from dflash_train.train.optim import lr_factor


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_steps_that_fit_follow_the_measured_step_time():
    clock = FakeClock()
    budget = TimeBudget(minutes=10, first_step=0, warmup_steps=5, every=10, clock=clock)
    clock.now = 30.0  # compile + warm-up steps, not timed
    assert budget.steps_that_fit(5, planned=10_000) is None  # the probe starts here
    clock.now = 30.0 + 10 * 0.5  # 10 steps of 0.5 s
    deadline = 600 * (1 - RESERVE)
    assert budget.steps_that_fit(15, planned=10_000) == 15 + int((deadline - clock.now) / 0.5)
    assert budget.steps_that_fit(16, planned=10_000) is None  # re-estimated every 10 steps only
    assert budget.steps_that_fit(25, planned=100) == 100  # never above the planned length
    clock.now = 1000.0
    assert budget.steps_that_fit(35, planned=10_000) == 35  # past the deadline: stop now


def test_estimates_are_reported_when_they_move_over_ten_percent():
    budget = TimeBudget(minutes=10, first_step=0, warmup_steps=5, every=10)
    reported = [n for n in (384, 400, 423, 430, 470, 618, 617) if budget.worth_reporting(n)]
    assert reported == [384, 423, 470, 618]


def test_a_budgeted_run_ends_early_with_its_schedule_complete(make_run_config, shared_tiny_target, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("dflash_train.train.budget.perf_counter", clock)
    cfg = make_run_config(overrides=["train.epochs=20", "train.time_budget_minutes=1", "train.log_every=1",
                                     "train.compile_warmup_steps=2", "train.warmup_ratio=0.1"])
    trainer = Trainer(cfg, target=shared_tiny_target)
    planned = trainer.progress.total_steps
    assert planned > 40
    step = trainer.train_step

    def timed_step():  # every step "takes" 2 s: 60 s x (1 - RESERVE) hold 29 steps
        clock.now += 2.0
        return step()

    monkeypatch.setattr(trainer, "train_step", timed_step)
    summary = trainer.fit(progress=False)
    assert summary["steps"] == 29
    lrs = [r["lr"] for r in read_metrics(cfg.run_dir)]
    assert len(lrs) == 29
    # Steps before the estimate followed the planned schedule. From the fit on, the warmup went on at
    # the 29-step run's slope (before, it jumped from ~14% to 100% of the peak in one step: the 29-step
    # warmup was already over), then the cosine fell, never back up, to its end at the last step
    # instead of being cut off near its peak.
    assert lrs[:3] == pytest.approx([cfg.train.lr * lr_factor(s, planned, 0.1, 0.0) for s in range(3)])
    assert max(b - a for a, b in zip(lrs, lrs[1:])) <= cfg.train.lr / round(0.1 * 29) + 1e-12
    peak = lrs.index(max(lrs))
    assert lrs[peak] == pytest.approx(cfg.train.lr) and 3 < peak < 10
    assert all(b <= a for a, b in zip(lrs[peak:], lrs[peak + 1 :]))
    assert lrs[-1] < 0.01 * cfg.train.lr


def test_the_estimate_follows_a_step_time_that_drops():
    """Cached features make every epoch after the first faster: the fit must use the recent step
    time, or the schedule ends long before the budget does."""
    clock = FakeClock()
    budget = TimeBudget(minutes=10, first_step=0, warmup_steps=0, every=10, clock=clock)
    budget.steps_that_fit(0, planned=100_000)
    step = 0
    for per_step in [1.0] * 10 + [0.25] * 10:  # 100 slow steps, then 100 fast ones
        step += 10
        clock.now += 10 * per_step
        fitted = budget.steps_that_fit(step, planned=100_000)
    deadline = 600 * (1 - RESERVE)
    assert fitted == step + int((deadline - clock.now) / 0.25)


def test_pauses_are_budgeted_apart_from_the_step_time():
    """A held-out probe is not step time: once it left the estimate windows, the old estimate read
    the bare step time and overran the budget by the probes still to come; while it was inside them,
    each step looked up to ten times slower."""
    clock = FakeClock()
    budget = TimeBudget(minutes=10, first_step=0, warmup_steps=5, every=10, clock=clock)
    clock.now = 30.0
    budget.steps_that_fit(5, planned=10_000, paused=1.0)  # paused during the warm-up: not the run's rate
    clock.now += 10 * 0.5 + 60.0  # 10 steps of 0.5 s and a 60 s probe among them
    deadline = 600 * (1 - RESERVE)
    for step in range(15, 66, 10):
        fitted = budget.steps_that_fit(step, planned=10_000, paused=61.0)
        assert fitted == step + int((deadline - clock.now) / (0.5 + 60 / (step - 5))), step
        clock.now += 10 * 0.5


def test_a_run_with_slow_pauses_decays_smoothly_and_ends_on_time(make_run_config, shared_tiny_target, monkeypatch):
    """Every 10th step a 20 s save (a held-out probe in a real run): the run ends at its budget and its
    lr falls along one cosine. Read as step time, each pause shrank the run's length for the next
    estimates, and the refitted cosine, which never climbs back, fell steeply after every probe."""
    import types

    from dflash_train.train import step_log

    clock = FakeClock()
    monkeypatch.setattr("dflash_train.train.budget.perf_counter", clock)
    monkeypatch.setattr(step_log, "time", types.SimpleNamespace(perf_counter=clock))
    cfg = make_run_config(overrides=["train.epochs=40", "train.time_budget_minutes=10", "train.log_every=1",
                                     "train.compile_warmup_steps=2", "train.warmup_ratio=0.05", "checkpoint.every=10"])
    trainer = Trainer(cfg, target=shared_tiny_target)
    assert trainer.progress.total_steps > 300
    step, save = trainer.train_step, trainer.checkpointer.save

    def timed_step():
        clock.now += 2.0
        return step()

    def slow_save(*args, **kw):
        clock.now += 20.0
        return save(*args, **kw)

    monkeypatch.setattr(trainer, "train_step", timed_step)
    monkeypatch.setattr(trainer.checkpointer, "save", slow_save)
    summary = trainer.fit(progress=False)
    deadline = 600 * (1 - RESERVE)
    assert deadline - 22 <= clock.now - 20 <= deadline  # the last save (20 s) after the final step
    lrs = [r["lr"] for r in read_metrics(cfg.run_dir)]
    assert len(lrs) == summary["steps"]
    peak = lrs.index(max(lrs))
    decay = len(lrs) - peak
    drops = [a - b for a, b in zip(lrs[peak:], lrs[peak + 1:])]
    # A cosine over `decay` steps falls at most pi / 2 / decay of the peak a step; the estimate's
    # saw-tooth between saves may steepen it a little, a pause read as step time did 10x.
    assert max(drops) <= 1.5 * math.pi / 2 / decay * cfg.train.lr, (max(drops), decay)
