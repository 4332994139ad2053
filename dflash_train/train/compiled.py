"""What a run's compiled paths share: the persistent compile cache and the watch on recompiles.

Set up while the run is built, before anything runs the drafter: a first flex_attention or layer
compile must land in the keyed, durable cache (never /tmp), and the watch must see it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dflash_train.checks import compile_cache
from dflash_train.checks.compile_settings import kernel_tuning_on
from dflash_train.checks.recompiles import RecompileWatch
from dflash_train.config import RunConfig
from dflash_train.draft.model import DFlashDraftModel
from dflash_train.train.shapes import bucket_shapes, compile_layers

log = logging.getLogger("dflash_train")


@dataclass
class Compilation:
    cache_key: str | None
    """The persistent cache's key; None when nothing is compiled (sdpa, no train.compile)."""
    cache_state: str | None
    """Whether the cache was cold, warm or stale when the run started."""
    recompiles: RecompileWatch

    @classmethod
    def for_run(cls, cfg: RunConfig, drafter: DFlashDraftModel, use_flex: bool) -> Compilation:
        """Activates the cache for the compiled paths (flex, only ever chosen on CUDA; train.compile;
        target.compile) and compiles the draft layers in place (train.compile)."""
        key = state = None
        if use_flex or cfg.train.compile or cfg.target.compile:
            key = compile_cache.cache_key()
            state = compile_cache.cache_state(key)
            compile_cache.activate(key)
            if tuning := kernel_tuning_on():  # the run's settings as set, by a variable or a library
                log.warning("%s on: every graph this run compiles tunes each of its kernels, minutes a graph "
                            "(`dflash-train doctor`)", ", ".join(tuning))
        recompiles = RecompileWatch()
        if cfg.train.compile:
            compile_layers(drafter, len(bucket_shapes(cfg.data)) if cfg.data.buckets else None)
        return cls(key, state, recompiles)
