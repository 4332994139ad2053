"""A drafter of its config's family, built from the class its family names (dflash_train/families)."""

from __future__ import annotations

import importlib

from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig
from dflash_train.families import family


def drafter_for(cfg: DraftModelConfig) -> DFlashDraftModel:
    """A drafter of `cfg.family`, initialised."""
    module, name = family(cfg.family).model.split(":")
    return getattr(importlib.import_module(module), name)(cfg)
