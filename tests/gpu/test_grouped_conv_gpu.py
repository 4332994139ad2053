"""On CUDA: DFlash2's grouped convolution kernel (draft/grouped_conv_kernel.py) against its PyTorch ops
in float64 on the CPU: output and the gradients of the input, the base kernel and the coefficient
projection, eager and compiled, at the SmolLM2 shape, at taps past the block's edge, and with a
group of 48 channels (the kernel's block rounded up to 64 and masked), and under every tiling.
Run: `python -m pytest tests/gpu -m gpu`."""

from __future__ import annotations

import pytest
import torch
from grouped_conv_check import check_kernels

from dflash_train.draft import grouped_conv_kernel as kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("hidden,group,taps,block,tokens",
                         [(576, 64, 2, 16, 48 * 16), (64, 16, 5, 4, 37 * 4), (144, 48, 2, 16, 9 * 16)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_kernel_is_the_ops_in_float64(hidden, group, taps, block, tokens, compiled):
    check_kernels(hidden, group, taps, block, tokens, "cuda", batch=2, compiled=compiled)


@pytest.mark.parametrize("launch", [(64, 4), (32, 4), (16, 2), (128, 8)], ids=str)
def test_every_launch_gives_the_ops_result(launch, monkeypatch):
    """The kernels' tiling (bench/grouped_conv.py picks it) changes no result: 37 blocks of 4 tokens
    leave the last program a partial tile."""
    monkeypatch.setattr(kernel, "FORWARD", kernel.Launch(*launch))
    monkeypatch.setattr(kernel, "BACKWARD", kernel.Launch(*launch))
    check_kernels(64, 16, 5, 4, 37 * 4, "cuda")
