"""On CUDA: DFlash2's grouped convolution kernel (draft/grouped_conv_kernel.py) against its PyTorch ops
in float64 on the CPU: output and the gradients of the input, the base kernel and the coefficient
projection, eager and compiled, at the SmolLM2 shape, at taps past the block's edge, and with a
group of 48 channels (the kernel's block rounded up to 64 and masked), and under every tiling.
Run: `python -m pytest tests/gpu -m gpu`."""

from __future__ import annotations

import copy

import pytest
import torch

from dflash_train.draft.dflash2 import GroupedConv
from dflash_train.draft.model import DraftModelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def conv_pair(conv, x, side_block):
    coeff = conv.coefficients(x)
    y = conv.convolve(x, coeff, 0, side_block)
    return conv.convolve(y, coeff, 1, side_block)


@pytest.mark.parametrize("hidden,group,taps,block,tokens",
                         [(576, 64, 2, 16, 48 * 16), (64, 16, 5, 4, 37 * 4), (144, 48, 2, 16, 9 * 16)])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_kernel_is_the_ops_in_float64(hidden, group, taps, block, tokens, compiled):
    cfg = DraftModelConfig(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           intermediate_size=64, num_hidden_layers=1, vocab_size=64, block_size=block,
                           target_layer_ids=[0], num_target_layers=2, mask_token_id=3, family="dflash2",
                           conv_kernel_size=taps, conv_group_size=group, selector_rank=4, selector_top_k=2)
    torch.manual_seed(0)
    ref = GroupedConv(cfg).double()
    torch.nn.init.normal_(ref.base_kernel)
    torch.nn.init.normal_(ref.kernel_projection.weight, std=0.1)
    x = torch.randn(2, tokens, hidden, dtype=torch.float64)
    grad = torch.randn(2, tokens, hidden, dtype=torch.float64)
    x_ref = x.clone().requires_grad_()
    want = conv_pair(ref, x_ref, block)
    want_grads = torch.autograd.grad(want, (x_ref, ref.base_kernel, ref.kernel_projection.weight), grad)

    conv = copy.deepcopy(ref).float().cuda()
    x_gpu = x.float().cuda().requires_grad_()
    fn = torch.compile(conv_pair, dynamic=False) if compiled else conv_pair
    got = fn(conv, x_gpu, block)
    got_grads = torch.autograd.grad(got, (x_gpu, conv.base_kernel, conv.kernel_projection.weight), grad.float().cuda())
    scale = lambda t: dict(rtol=1e-4, atol=1e-4 * float(t.abs().max()))  # noqa: E731
    torch.testing.assert_close(got.double().cpu(), want, **scale(want))
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double().cpu(), w, **scale(w))


@pytest.mark.parametrize("launch", [(64, 1, 4), (32, 4, 4), (16, 8, 2), (128, 2, 8)], ids=str)
def test_every_launch_gives_the_ops_result(launch, monkeypatch):
    """The kernels' tiling (bench/grouped_conv.py picks it) changes no result: 37 blocks of 4 tokens
    leave a program with a partial tile and steps past the end."""
    from dflash_train.draft import grouped_conv_kernel as kernel
    monkeypatch.setattr(kernel, "FORWARD", kernel.Launch(*launch))
    monkeypatch.setattr(kernel, "BACKWARD", kernel.Launch(*launch))
    test_the_kernel_is_the_ops_in_float64(64, 16, 5, 4, 37 * 4, compiled=False)
