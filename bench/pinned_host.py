"""How long torch takes to page-lock host memory: 1 GiB slabs, as the feature cache's host part takes
them (train/feature_cache.py), under whatever PYTORCH_CUDA_ALLOC_CONF the process started with.

    python3 bench/pinned_host.py                                       # cudaHostAlloc (torch's default)
    PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 \
        python3 bench/pinned_host.py                                   # what dflash_train sets

Prints one JSON line: the allocator setting, the seconds each slab took, and a loop of small kernel
launches with a small pinned allocation every 500 (a training step's pattern), timed before the slabs.
Run each setting in its own process: the variable is read once, and freed slabs stay cached.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def launch_loop(x: torch.Tensor, n: int = 20000) -> float:
    start = time.perf_counter()
    for i in range(n):
        x.add_(1)
        if i % 500 == 0:
            torch.empty(4096, pin_memory=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slabs", type=int, default=4)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("pinned_host.py measures page-locking for a CUDA device; none is available")
    torch.cuda.init()
    report = {"conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
              "launch_loop_s": launch_loop(torch.zeros(1024, 1024, device="cuda", dtype=torch.bfloat16))}
    slabs, seconds = [], []
    for _ in range(args.slabs):
        start = time.perf_counter()
        slabs.append(torch.empty(2**30, dtype=torch.uint8, pin_memory=True))
        seconds.append(round(time.perf_counter() - start, 3))
    report["seconds_per_gib_slab"] = seconds
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
