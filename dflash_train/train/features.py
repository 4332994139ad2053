"""Where a batch's target features come from: the feature cache in device and host memory
(`data.cache_features`), a capture on disk (`data.captured_features`), or the target itself."""

from __future__ import annotations

import torch

from dflash_train.config import RunConfig
from dflash_train.data.dataset import TokenizedDataset
from dflash_train.targets.model import Target
from dflash_train.train.capture import CapturedFeatures, fingerprint
from dflash_train.train.feature_cache import FeatureCache, HostSlabs, from_capture, from_target, step_reserve


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

    def __call__(self, batch: dict) -> torch.Tensor:
        if self.cache is not None:
            return self.cache.features(batch, self.make_rows)
        if self.captured is not None:
            return self.captured.batch(batch, self.device)
        return self.target.features(batch["input_ids"], self.stream_layers)
