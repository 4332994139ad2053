"""`dflash-train warmup`: fill the persistent compile cache before launch."""

from __future__ import annotations

import time

from dflash_train.config import RunConfig
from dflash_train.checks import compile_cache
from dflash_train.train.loop import Trainer


def warmup(cfg: RunConfig, steps: int | None = None) -> dict:
    """Compile every shape the run will see, into the persistent cache, before launch.

    Runs the first training steps on the real data (nothing is saved), then marks the cache warm.
    One process per GPU: compile is not thread-safe, and processes on one machine share the cache.
    """
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    if cfg.data.length_bucket:
        steps = trainer.compile_buckets()
    else:
        steps = steps or cfg.train.compile_warmup_steps
        for _ in range(min(steps, trainer.total_steps)):
            trainer.train_step()
    seconds = time.perf_counter() - t0
    info = {"steps": steps, "seconds": round(seconds, 1), "graphs": trainer.recompiles.graphs,
            "cache_state_before": trainer.compile_state}
    if trainer.compile_key:
        compile_cache.mark_warm(trainer.compile_key, info=info)
        info["cache"] = str(compile_cache.cache_root() / trainer.compile_key)
    return info
