"""`dflash-train warmup`: fill the persistent compile cache before launch."""

from __future__ import annotations

import time

from dflash_train.config import RunConfig
from dflash_train.checks import compile_cache
from dflash_train.train.build import build
from dflash_train.train.progress import Progress
from dflash_train.train.step import TrainStep


def warmup(cfg: RunConfig, steps: int | None = None) -> dict:
    """Compile every shape the run will see, into the persistent cache, before launch.

    Runs the first training steps on the real data (nothing is saved), then marks the cache warm.
    One process per GPU: compile is not thread-safe, and processes on one machine share the cache.
    """
    t0 = time.perf_counter()
    parts = build(cfg)
    step = TrainStep(cfg, parts)
    if cfg.data.buckets:
        steps = step.compile_buckets()
    else:
        steps = steps or cfg.train.compile_warmup_steps
        progress = Progress(total_steps=parts.total_steps)
        for _ in range(min(steps, progress.total_steps)):
            step(progress)
    seconds = time.perf_counter() - t0
    compiled = parts.compilation
    info = {"steps": steps, "seconds": round(seconds, 1), "graphs": compiled.recompiles.graphs,
            "cache_state_before": compiled.cache_state}
    if compiled.cache_key:
        compile_cache.mark_warm(compiled.cache_key, info=info)
        info["cache"] = str(compile_cache.cache_root() / compiled.cache_key)
    return info
