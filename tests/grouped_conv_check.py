"""DFlash2's grouped convolution kernels against `GroupedConv.convolve_ops` in float64: the output and
the gradients of the input, the base kernel and the coefficient projection, for one shape, run by
tests/draft/test_grouped_conv_kernel.py (Triton's interpreter on a CPU) and
tests/gpu/test_grouped_conv_gpu.py (compiled for a GPU)."""

from __future__ import annotations

import copy

import torch

from dflash_train.draft.dflash2 import GroupedConv
from dflash_train.draft.model import DraftModelConfig


def conv_pair(conv: GroupedConv, x: torch.Tensor, block: int, kernels: bool) -> torch.Tensor:
    """Both sides of one sublayer's convolution, as a layer runs them."""
    convolve = conv.convolve_kernel if kernels else conv.convolve_ops
    coeff = conv.coefficients(x)
    return convolve(convolve(x, coeff, 0, block), coeff, 1, block)


def conv_config(hidden: int, group: int, taps: int, block: int) -> DraftModelConfig:
    """A one-layer DFlash2 drafter's config around a convolution of this shape."""
    return DraftModelConfig(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            intermediate_size=64, num_hidden_layers=1, vocab_size=64, block_size=block,
                            target_layer_ids=[0], num_target_layers=2, mask_token_id=3, family="dflash2",
                            conv_kernel_size=taps, conv_group_size=group, selector_rank=4, selector_top_k=2)


def check_kernels(hidden: int, group: int, taps: int, block: int, tokens: int, device: str, batch: int = 1,
                  compiled: bool = False) -> None:
    cfg = conv_config(hidden, group, taps, block)
    torch.manual_seed(0)
    ref = GroupedConv(cfg).double()
    torch.nn.init.normal_(ref.base_kernel)
    torch.nn.init.normal_(ref.kernel_projection.weight, std=0.1)
    x = torch.randn(batch, tokens, hidden, dtype=torch.float64)
    grad = torch.randn_like(x)
    x_ref = x.clone().requires_grad_()
    want = conv_pair(ref, x_ref, block, kernels=False)
    want_grads = torch.autograd.grad(want, (x_ref, ref.base_kernel, ref.kernel_projection.weight), grad)

    conv = copy.deepcopy(ref).float().to(device)
    x_k = x.float().to(device).requires_grad_()
    fn = torch.compile(conv_pair, dynamic=False) if compiled else conv_pair
    got = fn(conv, x_k, block, True)
    got_grads = torch.autograd.grad(got, (x_k, conv.base_kernel, conv.kernel_projection.weight),
                                    grad.float().to(device))
    scale = lambda t: dict(rtol=1e-4, atol=1e-4 * float(t.abs().max()))  # noqa: E731
    torch.testing.assert_close(got.double().cpu(), want, **scale(want))
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double().cpu(), w, **scale(w))
