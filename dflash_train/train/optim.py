"""AdamW and the warmup + cosine learning-rate schedule."""

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


def lr_factor(step: int, total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    """Linear warmup over warmup_ratio x total steps, then cosine down to min_lr_ratio."""
    warmup = max(int(round(warmup_ratio * total_steps)), 0)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total_steps - warmup, 1)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def build_scheduler(optimizer, cfg: TrainConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_ratio, cfg.min_lr_ratio)
    )


def retarget_scheduler(scheduler, cfg: TrainConfig, total_steps: int) -> None:
    """From its current step on, `scheduler` follows the schedule of a `total_steps` run, and the
    optimizer's rates are set to that schedule's value now (no jump when the length is unchanged)."""
    factor = lambda step: lr_factor(step, total_steps, cfg.warmup_ratio, cfg.min_lr_ratio)  # noqa: E731
    scheduler.lr_lambdas = [factor] * len(scheduler.optimizer.param_groups)
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
