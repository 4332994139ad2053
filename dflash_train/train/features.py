"""Where a batch's target features come from: the feature cache in device and host memory
(`data.cache_features`), a capture on disk (`data.captured_features`), or the target itself."""

from __future__ import annotations

import logging

import torch

from dflash_train.config import RunConfig
from dflash_train.data.dataset import TokenizedDataset
from dflash_train.targets.model import Target
from dflash_train.train.capture import CapturedFeatures, fingerprint
from dflash_train.train.feature_cache import FeatureCache, HostSlabs, from_capture, from_target, step_reserve

log = logging.getLogger("dflash_train")

STEP_MARGIN = 1.25
"""The measured step's memory times this (plus 1 GiB) is what the cache leaves free: real batches
and the allocator's fragmentation take more than the warm-up's synthetic ones."""


class Features:
    def __init__(self, cfg: RunConfig, target: Target, dataset: TokenizedDataset, stream_layers: list[int],
                 device: torch.device, chunk_rows: int):
        self.target, self.stream_layers, self.device = target, stream_layers, device
        self.captured = None
        if cfg.data.captured_features:  # refused when captured from another target, layers or data
            self.captured = CapturedFeatures(cfg.data.captured_features, fingerprint(target, stream_layers, dataset))
        self.cache = None
        if cfg.data.cache_features:
            limit = None if cfg.data.cache_host_gib is None else int(cfg.data.cache_host_gib * 2**30)
            host = HostSlabs(pin=device.type == "cuda", limit=limit)
            self.cache = FeatureCache(device, step_reserve(chunk_rows, target.vocab_size), host, len(dataset))
        # where the cache's missing rows come from
        self.make_rows = (from_capture(self.captured, device) if self.captured is not None else
                          from_target(dataset, device, lambda ids: target.features(ids, stream_layers)))

    def reserve_for_step(self, step_bytes: int) -> None:
        """The cache leaves free at least what the drafter's step was measured to take (its warm-up
        over every bucket shape), with a margin: a family whose step needs more than the estimate
        (`step_reserve`) keeps its room, instead of running out of memory once the cache has grown."""
        if self.cache is None:
            return
        measured = int(step_bytes * STEP_MARGIN) + 2**30
        if measured > self.cache.reserve_bytes:
            log.info("feature cache: leaves %.1f GiB free for the step (measured %.1f GiB; estimate %.1f GiB)",
                     measured / 2**30, step_bytes / 2**30, self.cache.reserve_bytes / 2**30)
            self.cache.reserve_bytes = measured

    def __call__(self, batch: dict) -> torch.Tensor:
        if self.cache is not None:
            return self.cache.features(batch, self.make_rows)
        if self.captured is not None:
            return self.captured.batch(batch, self.device)
        return self.target.features(batch["input_ids"], self.stream_layers)
