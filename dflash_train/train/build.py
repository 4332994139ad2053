"""`build(cfg)`: a run's components, constructed in the order the data flows through them.

data files (checked first: a typo fails before a big target loads) -> target -> tokenized data ->
drafter -> objective (loss mix, captured layers) -> epoch plan -> optimizer and schedule. The
Trainer (train/loop.py) adds the loop, records and checkpoints around these; the warm-up, the
benchmarks and the distributed ranks get the same parts from the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash_train.config import RunConfig
from dflash_train.data.dataset import TokenizedDataset
from dflash_train.disk import require_writable
from dflash_train.draft.loss import LossMix
from dflash_train.draft.model import DFlashDraftModel
from dflash_train.checks import compile_cache
from dflash_train.targets.model import Target, resolve_device
from dflash_train.train.batches import epoch_plan
from dflash_train.train.shapes import stream_layer_ids
from dflash_train.train.drafter_init import build_drafter
from dflash_train.train.inputs import load_inputs
from dflash_train.train.optim import build_optimizer, build_scheduler


@dataclass
class RunParts:
    device: torch.device
    target: Target
    dataset: TokenizedDataset
    drafter: DFlashDraftModel
    loss_mix: LossMix
    stream_layers: list[int]
    """Target layers captured per micro-batch (the drafter's, plus the last when the loss distils)."""
    use_flex: bool
    epoch_batches: list[list[np.ndarray]]
    total_steps: int
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def check_write_locations(cfg: RunConfig) -> None:
    """Before the target loads (minutes for a big one): the run directory can be written, and the
    persistent compile cache when a compiled path (train.compile, flex attention on CUDA) will be."""
    require_writable(cfg.run_dir, "the run's checkpoints and metrics")
    if cfg.train.compile or (cfg.draft.attention != "sdpa" and resolve_device(cfg.device).type == "cuda"):
        require_writable(compile_cache.cache_root(), "the compile cache")


def build(cfg: RunConfig, target: Target | None = None, dataset: TokenizedDataset | None = None) -> RunParts:
    """The parts of `cfg`'s run; `target` and `dataset` when the caller already holds them."""
    if cfg.draft.attention == "flex" and resolve_device(cfg.device).type != "cuda":
        raise ValueError("draft.attention: flex has no backward on CPU; use 'sdpa' or 'auto' there")
    device, target, dataset = load_inputs(cfg, target, dataset)
    drafter = build_drafter(cfg, target, device)  # seeds the RNG itself, right before its weights
    epoch_batches = epoch_plan(cfg, dataset.lengths)
    micro_total = sum(len(b) for b in epoch_batches)
    total_steps = cfg.train.max_steps or max(micro_total // cfg.train.grad_accum, 1)
    optimizer = build_optimizer(drafter.parameters(), cfg.train, device)
    return RunParts(
        device=device, target=target, dataset=dataset, drafter=drafter,
        loss_mix=LossMix.from_weights(cfg.objective.loss, cfg.objective.kd_temperature),
        stream_layers=stream_layer_ids(cfg, target),
        use_flex=cfg.draft.attention == "flex" or (cfg.draft.attention == "auto" and device.type == "cuda"),
        epoch_batches=epoch_batches, total_steps=total_steps, optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.train, total_steps),
    )
