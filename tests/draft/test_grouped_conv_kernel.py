"""DFlash2's grouped convolution kernels (draft/grouped_conv_kernel.py), their Triton source run on the
CPU by Triton's interpreter, against `GroupedConv.convolve_ops` in float64: the output and the
gradients of the input, the base kernel and the coefficient projection, eager and under
torch.compile (the custom ops' fake shapes), under several tilings, with a partial last tile, taps
past the block's edge and a group whose channels are masked. tests/gpu/test_grouped_conv_gpu.py runs
the same kernels compiled for a GPU."""

from __future__ import annotations

import os

import pytest
import torch
from grouped_conv_check import check_kernels, conv_config

from dflash_train.draft import grouped_conv_kernel as kernel
from dflash_train.draft.dflash2 import GroupedConv

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="on a CUDA machine the kernels are built for the GPU: tests/gpu/test_grouped_conv_gpu.py runs them there")


@pytest.mark.parametrize("hidden,group,taps,block,blocks", [(576, 64, 2, 16, 9), (64, 16, 5, 4, 37), (144, 48, 2, 16, 5)])
def test_the_kernels_are_the_ops(hidden, group, taps, block, blocks):
    check_kernels(hidden, group, taps, block, blocks * block, "cpu")


@pytest.mark.parametrize("launch", [(32, 4), (16, 2)], ids=str)
def test_every_tiling_gives_the_ops_result(launch, monkeypatch):
    """37 blocks of 4 tokens: the last program's tile is partial under each tiling."""
    monkeypatch.setattr(kernel, "FORWARD", kernel.Launch(*launch))
    monkeypatch.setattr(kernel, "BACKWARD", kernel.Launch(*launch))
    check_kernels(64, 16, 5, 4, 37 * 4, "cpu")


def test_compiled_the_kernels_are_the_ops():
    """torch.compile calls the custom ops as they are; their fake outputs' shapes (the base kernel's
    shares among them) must be the kernels' own."""
    torch._dynamo.reset()
    check_kernels(144, 48, 2, 16, 5 * 16, "cpu", compiled=True)


def test_the_custom_ops_pass_torch_opcheck():
    """torch.library.opcheck: the fake implementations' outputs are the kernels' (shapes, strides,
    dtypes: what torch.compile plans with), the autograd registration, the schema."""
    torch.manual_seed(0)
    n, hidden, groups, taps = 5 * 16, 144, 3, 2
    x, grad = torch.randn(n, hidden), torch.randn(n, hidden)
    coeff, base = torch.randn(n, taps, groups), torch.randn(taps, hidden)
    torch.library.opcheck(kernel.grouped_conv, (x.requires_grad_(), coeff.requires_grad_(), base.requires_grad_(), 16))
    torch.library.opcheck(kernel.grouped_conv_backward, (grad, x.detach(), coeff.detach(), base.detach(), 16))


def test_under_autocast_the_kernel_reads_and_writes_the_autocast_dtype():
    """Fed the norm's fp32 output under bf16 autocast, the convolution runs on the input rounded to bf16
    and returns bf16 (what the next matmul takes, no cast pass between); the input's gradient comes back
    in fp32."""
    torch.manual_seed(0)
    conv = GroupedConv(conv_config(144, 48, 2, 16))
    torch.nn.init.normal_(conv.base_kernel)
    x = torch.randn(1, 5 * 16, 144, requires_grad=True)
    coeff = torch.randn(1, 5 * 16, 2, 2, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = conv.convolve_kernel(x, coeff, 0, 16)
    assert got.dtype == torch.bfloat16
    want = conv.convolve_ops(x.detach().bfloat16().double(), coeff.double(), 0, 16)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    got.float().sum().backward()
    assert x.grad.dtype == torch.float32
