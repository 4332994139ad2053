"""AdamW and the learning-rate schedules: linear warmup, then cosine or warmup-stable-decay (WSD)."""

from __future__ import annotations

import math

import torch

from dflash_train.config import TrainConfig


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
    warmup = max(int(round(warmup_ratio * total_steps)), 0)
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "wsd":
        decay_start = max(warmup, total_steps - int(round(decay_ratio * total_steps)))
        if step < decay_start:
            return 1.0
        progress = min((step - decay_start) / max(total_steps - decay_start, 1), 1.0)
        return min_lr_ratio + (1 - min_lr_ratio) * (1 - math.sqrt(progress))
    progress = (step - warmup) / max(total_steps - warmup, 1)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def schedule_of(cfg: TrainConfig, total_steps: int):
    """step -> lr factor of a `total_steps` run under `cfg`'s schedule."""
    return lambda step: lr_factor(step, total_steps, cfg.warmup_ratio, cfg.min_lr_ratio, cfg.schedule,
                                  cfg.decay_ratio)


def build_scheduler(optimizer, cfg: TrainConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_of(cfg, total_steps))


def retarget_scheduler(scheduler, cfg: TrainConfig, total_steps: int) -> None:
    """From its current step on, `scheduler` follows the schedule of a `total_steps` run, and the
    optimizer's rates are set to that schedule's value now (no jump when the length is unchanged)."""
    factor = schedule_of(cfg, total_steps)
    scheduler.lr_lambdas = [factor] * len(scheduler.optimizer.param_groups)
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
