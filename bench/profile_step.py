"""CUDA time of one callable by kernel family (torch.profiler), for deciding what to speed up."""

from __future__ import annotations

import re
from collections import defaultdict

import torch

FAMILIES = [  # first match wins; names are the kernels' own (cuBLAS, flash/flex, triton, ATen)
    ("matmul", r"gemm|matmul|cutlass|sm90_xmma|nvjet|_mm_|addmm|bmm"),
    ("attention", r"flash|flex|attention|fmha|sdpa|efficient_attention"),
    ("softmax / cross-entropy", r"softmax|cross_entropy|nll_loss|logsumexp"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("norms", r"norm|rsqrt"),
    ("copies / gathers / indexing", r"copy|gather|scatter|index|cat_|memcpy|memset|fill"),
    ("reductions", r"reduce|sum_|argmax|max_"),
]


def family(name: str) -> str:
    lowered = name.lower()
    return next((f for f, pattern in FAMILIES if re.search(pattern, lowered)), "elementwise / other")


def profile(fn, steps: int = 3) -> dict:
    """{family: ms per call}, the wall ms per call, and the 12 costliest kernels."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
    by_family: dict[str, float] = defaultdict(float)
    kernels = []
    for e in prof.key_averages():
        cuda_us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if cuda_us <= 0 or e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        by_family[family(e.key)] += cuda_us / 1e3 / steps
        kernels.append((cuda_us / 1e3 / steps, e.key[:90]))
    wall = start.elapsed_time(end) / steps
    busy = sum(by_family.values())
    return {"wall_ms": round(wall, 3), "kernel_ms": round(busy, 3), "gaps_ms": round(wall - busy, 3),
            "families_ms": {k: round(v, 3) for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [(round(ms, 3), name) for ms, name in sorted(kernels, reverse=True)[:12]]}
