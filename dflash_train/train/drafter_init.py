"""The drafter a run starts from: seeded fresh weights.

Fresh weights come from the global RNG seeded with `seed` RIGHT before the drafter is built: loading
the target (its one-time GGUF conversion initialises a model too) draws from the same RNG, so seeding
any earlier would make the drafter depend on whether that conversion ran in this process.
"""

from __future__ import annotations

import torch

from dflash_train.config import RunConfig
from dflash_train.draft.model import DFlashDraftModel
from dflash_train.target import Target
from dflash_train.train.build import draft_model_config


def build_drafter(cfg: RunConfig, target: Target, device: torch.device) -> DFlashDraftModel:
    torch.manual_seed(cfg.seed)
    drafter = DFlashDraftModel(draft_model_config(cfg, target))
    return drafter.to(device)
