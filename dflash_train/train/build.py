"""`build(cfg)`: a run's components, constructed in the order the data flows through them.

write locations and data files (checked first: a typo fails before a big target loads) -> target ->
tokenized data -> drafter -> objective (the forward, captured layers) -> epoch plan -> optimizer and
schedule -> where the features come from -> the compile cache and compiled layers. The loop (train/loop.py) adds its steps, records and
checkpoints around these; the warm-up, the benchmarks, the quickstart and the distributed ranks get
the same parts from the same function.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from dflash_train.config import RunConfig
from dflash_train.data.dataset import TokenizedDataset
from dflash_train.disk import require_writable
from dflash_train.draft.fp8 import convert_to_fp8
from dflash_train.draft.model import DFlashDraftModel
from dflash_train.checks import compile_cache
from dflash_train.checks.fp8 import fp8_device_problem, fp8_problem
from dflash_train.targets.model import Target, resolve_device
from dflash_train.train.batches import epoch_plan
from dflash_train.train.compiled import Compilation
from dflash_train.train.drafter_init import build_drafter
from dflash_train.train.features import Features
from dflash_train.train.forward import DraftForward
from dflash_train.train.inputs import load_inputs
from dflash_train.train.optim import build_optimizer, build_scheduler
from dflash_train.train.shapes import stream_layer_ids


log = logging.getLogger("dflash_train")

@dataclass
class RunParts:
    device: torch.device
    target: Target
    dataset: TokenizedDataset
    drafter: DFlashDraftModel
    stream_layers: list[int]
    """Target layers captured per micro-batch (the drafter's, plus the last when the loss distils)."""
    forward: DraftForward
    epoch_batches: list[list[np.ndarray]]
    total_steps: int
    """The plan's optimizer steps (train.max_steps, or the epochs' micro-batches over grad_accum)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    features: Features
    compilation: Compilation


def check_write_locations(cfg: RunConfig) -> None:
    """Before the target loads (minutes for a big one): the run directory can be written, and the
    persistent compile cache when a compiled path (train.compile, target.compile, flex attention on
    CUDA) will be."""
    require_writable(cfg.run_dir, "the run's checkpoints and metrics")
    if cfg.train.compile or cfg.target.compile or (cfg.draft.attention != "sdpa"
                                                    and resolve_device(cfg.device).type == "cuda"):
        require_writable(compile_cache.cache_root(), "the compile cache")


def build(cfg: RunConfig, target: Target | None = None, dataset: TokenizedDataset | None = None) -> RunParts:
    """The parts of `cfg`'s run; `target` and `dataset` when the caller already holds them."""
    check_write_locations(cfg)
    if cfg.draft.attention == "flex" and resolve_device(cfg.device).type != "cuda":
        raise ValueError("draft.attention: flex has no backward on CPU; use 'sdpa' or 'auto' there")
    if cfg.draft.fp8 != "off" and (problem := fp8_problem(resolve_device(cfg.device))):
        raise ValueError(f"draft.fp8={cfg.draft.fp8}: {problem}")  # before the target loads
    if cfg.train.fp8_lm_head and (problem := fp8_device_problem(resolve_device(cfg.device))):
        raise ValueError(f"train.fp8_lm_head: {problem}")
    device, target, dataset = load_inputs(cfg, target, dataset)
    drafter = build_drafter(cfg, target, device)  # seeds the RNG itself, right before its weights
    drafter.recompute_layers = cfg.train.activation_checkpointing
    if cfg.draft.fp8 != "off":  # before the optimizer and torch.compile see the layers
        log.info("draft.fp8=%s: %d linear layers in FP8", cfg.draft.fp8, convert_to_fp8(drafter, cfg.draft.fp8))
    epoch_batches = epoch_plan(cfg, dataset.lengths)
    micro_total = sum(len(b) for b in epoch_batches)
    total_steps = cfg.train.max_steps or max(micro_total // cfg.train.grad_accum, 1)
    optimizer = build_optimizer(drafter.parameters(), cfg.train, device)
    scheduler = build_scheduler(optimizer, cfg.train, total_steps)
    use_flex = cfg.draft.attention == "flex" or (cfg.draft.attention == "auto" and device.type == "cuda")
    forward = DraftForward.for_run(cfg, drafter, target, device, use_flex)
    stream_layers = stream_layer_ids(cfg, target)
    return RunParts(
        device=device, target=target, dataset=dataset, drafter=drafter, stream_layers=stream_layers,
        forward=forward, epoch_batches=epoch_batches, total_steps=total_steps, optimizer=optimizer,
        scheduler=scheduler, features=Features(cfg, target, dataset, stream_layers, device, forward.chunk_rows),
        compilation=Compilation.for_run(cfg, drafter, use_flex),
    )
