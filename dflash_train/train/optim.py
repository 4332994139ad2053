"""AdamW and the learning-rate schedules: linear warmup, then cosine or warmup-stable-decay (WSD)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_train.config_training import TrainConfig


def build_optimizer(params, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        weight_decay=cfg.weight_decay,
        fused=device.type == "cuda",
    )


def lr_factor(step: int, total_steps: int, warmup_ratio: float, min_lr_ratio: float,
              schedule: str = "cosine", decay_ratio: float = 0.2) -> float:
    """Linear warmup over warmup_ratio x total steps, then down to min_lr_ratio at `total_steps`:
    cosine: over all steps after the warmup.
    wsd: flat at the peak, then the last decay_ratio x total steps decay as 1 - sqrt(progress).
    1-sqrt rather than linear: Hägele et al. 2024 ("Scaling Laws and Compute-Optimal Training Beyond
    Fixed Training Durations") found it beat a linear cooldown of the same length; it drops fast at
    first and flattens out at the end, where the smallest rates still help."""
    return Schedule(total_steps, warmup_ratio, min_lr_ratio, schedule, decay_ratio)(step)


def decay_curve(progress: float, min_lr_ratio: float, schedule: str) -> float:
    """The decay's factor at `progress` (0 -> 1) of it: cosine, or wsd's 1 - sqrt."""
    shape = 1 - math.sqrt(progress) if schedule == "wsd" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr_ratio + (1 - min_lr_ratio) * shape


@dataclass
class Schedule:
    """step -> lr factor of a `total_steps` run (`lr_factor`), or of one refitted to that length at
    step `start` (time budgets; see `refit`). A plain object, not a closure, so that LambdaLR's
    state_dict keeps a refitted schedule across a checkpoint and resume."""

    total_steps: int
    warmup_ratio: float
    min_lr_ratio: float
    schedule: str
    decay_ratio: float
    start: int | None = None
    """Refitted at this step; None: the run's own schedule from step 0."""
    start_factor: float = 0.0
    """Refitted during the warmup (or wsd's flat part): the factor at `start`, ramped on to 1."""
    start_progress: float | None = None
    """Refitted during the decay: how far along its curve it was at `start`."""

    def __call__(self, step: int) -> float:
        phase, value = self.position(step)
        return decay_curve(value, self.min_lr_ratio, self.schedule) if phase == "decay" else value

    def _warmup_end(self) -> int:
        """A warmup under way at `start` goes on at this length's warmup slope (at least one step's
        worth), never faster, unless that leaves the decay less than half the steps left: the run
        must still end at min_lr_ratio."""
        if self.start_factor >= 1:
            return self.start
        ramp = math.ceil((1 - self.start_factor) * round(self.warmup_ratio * self.total_steps) - 1e-9)  # no float step
        return self.start + max(1, min(ramp, (self.total_steps - self.start) // 2))

    def _decay_start(self, warmup_end: int) -> int:
        if self.schedule == "wsd":
            return max(warmup_end, self.total_steps - int(round(self.decay_ratio * self.total_steps)))
        return warmup_end

    def position(self, step: int) -> tuple[str, float]:
        """("warmup", factor), ("flat", 1.0) or ("decay", progress along the decay curve) at `step`."""
        if self.start is None:  # the run's own: (step + 1) / warmup steps, so step 0 already trains
            warmup_end = max(int(round(self.warmup_ratio * self.total_steps)), 0)
            if step < warmup_end:
                return "warmup", (step + 1) / warmup_end
        elif self.start_progress is not None:
            done = (max(step, self.start) - self.start) / max(self.total_steps - self.start, 1)
            return "decay", min(self.start_progress + (1 - self.start_progress) * done, 1.0)
        else:
            step = max(step, self.start)  # a refitted schedule has no steps before its start
            warmup_end = self._warmup_end()
            if step < warmup_end:
                return "warmup", self.start_factor + (1 - self.start_factor) * (step - self.start) / (warmup_end - self.start)
        decay_start = self._decay_start(warmup_end)
        if step < decay_start:
            return "flat", 1.0
        return "decay", min((step - decay_start) / max(self.total_steps - decay_start, 1), 1.0)

    def refit(self, step: int, total_steps: int) -> Schedule:
        """This schedule continued from `step` for a run of `total_steps`, without a jump: a warmup
        under way ramps on at the new length's slope from today's factor (the first time-budget fit
        comes after the compile warm-up, when the new length's whole warmup may be nearly over:
        jumping there took the rate from ~2% to 75% of its peak in one step); a decay maps the
        progress made onto the steps left (the same curve when the length is unchanged, and never
        back up when it grows)."""
        if total_steps == self.total_steps:
            return self  # the same curve, to the bit (a resumed run's rates equal the saved run's)
        phase, value = self.position(step)
        fields = dict(total_steps=total_steps, warmup_ratio=self.warmup_ratio, min_lr_ratio=self.min_lr_ratio,
                      schedule=self.schedule, decay_ratio=self.decay_ratio, start=step)
        if phase == "decay":
            return Schedule(**fields, start_progress=value)
        return Schedule(**fields, start_factor=value)


def schedule_of(cfg: TrainConfig, total_steps: int) -> Schedule:
    """step -> lr factor of a `total_steps` run under `cfg`'s schedule."""
    return Schedule(total_steps, cfg.warmup_ratio, cfg.min_lr_ratio, cfg.schedule, cfg.decay_ratio)


def build_scheduler(optimizer, cfg: TrainConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_of(cfg, total_steps))


def _set_schedule(scheduler, factor) -> None:
    scheduler.lr_lambdas = [factor] * len(scheduler.optimizer.param_groups)
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def retarget_scheduler(scheduler, cfg: TrainConfig, total_steps: int) -> None:
    """From its current step on, `scheduler` follows the schedule of a `total_steps` run, and the
    optimizer's rates are set to that schedule's value now (no jump when the length is unchanged):
    a fixed-length run resumed with another `max_steps`."""
    _set_schedule(scheduler, schedule_of(cfg, total_steps))


def refit_scheduler(scheduler, total_steps: int) -> None:
    """`scheduler`'s schedule continued for a run of `total_steps` from its current step
    (`Schedule.refit`): what a time budget does each time it re-estimates the steps that fit."""
    _set_schedule(scheduler, scheduler.lr_lambdas[0].refit(scheduler.last_epoch, total_steps))
