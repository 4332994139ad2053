"""How torch page-locks host memory in our processes: by registering memory it has already mapped,
page-faulted by several threads, not through cudaHostAlloc.

The feature cache keeps the rows past the device's room in page-locked 1 GiB slabs, tens of them
(train/feature_cache.py). On an H200 host, torch 2.11, cudaHostAlloc took 0.46-0.68 s per GiB and
torch's register mode with 8 threads 0.13-0.15 s (results/smollm2-h200/pinned-host/), and the
training step waits for each slab: the SmolLM2 chain's ~53 slabs, ~36 s at the first rate, about
what its first epoch lost once rows went to the host (docs/benchmarks/chain.md). The mode is a
PYTORCH_CUDA_ALLOC_CONF key that torch reads from the environment, so it is set before torch is
imported, and only where the user has chosen no pinned-memory setting of their own.
"""

from __future__ import annotations

import os
import sys

PINNED_BY_REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def pin_by_registering(environ=os.environ, modules=sys.modules) -> bool:
    """Adds PINNED_BY_REGISTER to the allocator variable torch reads first (PYTORCH_ALLOC_CONF where
    set, else PYTORCH_CUDA_ALLOC_CONF), keeping what it holds; returns whether it did. Nothing changes once torch is imported (it may have read the variable already) or where
    either allocator variable already names a pinned-memory key."""
    if "torch" in modules or any("pinned_" in environ.get(name, "") for name in ALLOC_CONF_VARS):
        return False
    name = "PYTORCH_ALLOC_CONF" if environ.get("PYTORCH_ALLOC_CONF") else "PYTORCH_CUDA_ALLOC_CONF"
    environ[name] = ",".join(filter(None, [environ.get(name), PINNED_BY_REGISTER]))
    return True
