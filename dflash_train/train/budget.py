"""Wall-clock limits of one `fit`: a budget that refits the schedule, or a deadline that never does.

TimeBudget (runs without max_steps): once the step time is known (after the compile warm-up), the
run's total steps shrink to those that fit in the time left, re-estimated as training goes on from
the step time of the last few estimate windows (not the whole run: with `data.cache_features` the
first epoch also runs the target and later steps are much faster); the run then refits the
schedule to that length without a jump (`optim.Schedule.refit`). Cutting a run by a timeout instead
would stop it at a high learning rate.
Pauses (held-out probes, checkpoint saves) are kept out of the step time and budgeted apart, at the
run's average pause per step so far: a 16 s probe inside an 80-step estimate of 20 ms steps made
each step look ten times slower, shrank the run to a tenth of what fitted, and the refitted cosine
(which never climbs back) fell to ~0 and left the last 300 steps of a 4-minute run at no rate.
Deadline (fixed-length runs): the run saves and exits when it is reached, and the next call
resumes the SAME schedule; refitting in every call would push the learning rate back up each time.
TimeLimits applies both to a run's progress after every step.
"""

from __future__ import annotations

import logging
from collections import deque
from time import perf_counter

import torch

from dflash_train.config_training import TrainConfig
from dflash_train.train.optim import refit_scheduler
from dflash_train.train.progress import Progress

log = logging.getLogger("dflash_train")

RESERVE = 0.03
"""Share of the budget kept for the final checkpoint and summary."""
WINDOWS = 4
"""Estimate windows (of `every` steps) the step time is measured over."""


class TimeBudget:
    def __init__(self, minutes: float, first_step: int, warmup_steps: int, every: int, clock=None):
        self.clock = clock or perf_counter
        self.deadline = self.clock() + 60.0 * minutes * (1 - RESERVE)
        self.probe_step = first_step + warmup_steps  # compile-free steps only are timed
        self.every = max(1, every)
        self.marks: deque[tuple[int, float]] = deque(maxlen=WINDOWS + 1)  # (step, training clock) per estimate
        self.paused_at_probe = 0.0
        self.reported: int | None = None

    def worth_reporting(self, fitted: int) -> bool:
        """The first estimate, then each that moved over 10% from the last one reported: the first
        can be far off while later buckets still compile, and its re-estimates are otherwise silent."""
        if self.reported is not None and abs(fitted - self.reported) <= 0.1 * self.reported:
            return False
        self.reported = fitted
        return True

    def steps_that_fit(self, step: int, planned: int, paused: float = 0.0) -> int | None:
        """The run's total steps given the time left (never above `planned`), re-estimated every
        `every` steps after the probe; None while the step time is not known yet. `paused`: the
        seconds the run has spent in pauses so far (they count against the budget, not the step)."""
        if step == self.probe_step:
            self.marks.append((step, self.clock() - paused))
            self.paused_at_probe = paused
            return None
        if not self.marks or (step - self.probe_step) % self.every:
            return None
        now = self.clock()
        self.marks.append((step, now - paused))
        first_step, first_time = self.marks[0]
        per_step = (now - paused - first_time) / (step - first_step)
        pause_per_step = (paused - self.paused_at_probe) / (step - self.probe_step)
        return min(planned, step + max(0, int((self.deadline - now) / (per_step + pause_per_step))))


class Deadline:
    def __init__(self, minutes: float, clock=None):
        self.clock = clock or perf_counter
        self.at = self.clock() + 60.0 * minutes * (1 - RESERVE)

    def reached(self) -> bool:
        return self.clock() >= self.at


class TimeLimits:
    """`train.time_budget_minutes` and `train.deadline_minutes` of one call, from now."""

    def __init__(self, tc: TrainConfig, progress: Progress, scheduler: torch.optim.lr_scheduler.LRScheduler):
        self.planned, self.scheduler = progress.total_steps, scheduler
        self.budget = tc.time_budget_minutes and TimeBudget(tc.time_budget_minutes, progress.step,
                                                            tc.compile_warmup_steps, tc.log_every)
        self.deadline = tc.deadline_minutes and Deadline(tc.deadline_minutes)

    def maybe_stop(self, progress: Progress, paused: float) -> None:
        """After a step: shortens the run (and its schedule) to what fits in the budget, or stops it at
        the deadline. `paused`: the seconds spent between steps so far."""
        fitted = self.budget and self.budget.steps_that_fit(progress.step, self.planned, paused)
        if fitted and fitted != progress.total_steps:
            log.log(logging.INFO if self.budget.worth_reporting(fitted) else logging.DEBUG,
                    "time budget: %d of %d planned steps fit; the schedule now ends there", fitted, self.planned)
            progress.total_steps = fitted
            refit_scheduler(self.scheduler, fitted)
        if self.deadline and progress.step < progress.total_steps and self.deadline.reached():
            progress.stopped = "deadline"  # the final save holds this step; the schedule is left as it is
            log.info("deadline: stopping at step %d of %d; --resume auto continues the same schedule",
                     progress.step, progress.total_steps)
