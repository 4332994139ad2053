"""`train.activation_checkpointing`: each draft layer keeps only its input for the backward and runs
again there. The gradients are the plain backward's, and the activations inside the layers are not
kept (counted through the saved-tensor hooks autograd packs every saved tensor with), eager and with
the layers compiled as training compiles them."""

from __future__ import annotations

import pytest
import torch

from dflash_train.draft import masks
from dflash_train.draft.build import drafter_for
from draft.helpers_draft import tiny_draft_config

FAMILIES = {"dflash": {}, "dflash2": dict(family="dflash2", conv_kernel_size=2, conv_group_size=8, selector_rank=4,
                                          selector_top_k=2)}


def drafter_and_inputs(family: str, dtype=torch.float64):
    torch.manual_seed(0)
    drafter = drafter_for(tiny_draft_config(num_hidden_layers=3, **FAMILIES[family])).to(dtype)
    d = drafter.config
    anchors, t = torch.tensor([[2, 7, 11], [5, 9, 0]]), 16
    gen = torch.Generator().manual_seed(1)
    ctx = torch.randn(2, t, len(d.target_layer_ids) * d.hidden_size, generator=gen, dtype=dtype)
    emb = torch.randn(2, anchors.shape[1] * d.block_size, d.hidden_size, generator=gen, dtype=dtype)
    args = (ctx, emb, torch.arange(t).expand(2, t), masks.block_positions(anchors, d.block_size),
            masks.dense_mask(anchors, d.block_size, t))
    return drafter, args


def backward(drafter, args, recompute: bool):
    """(output, every parameter's gradient, bytes of the tensors autograd kept for the backward)."""
    drafter.recompute_layers = recompute
    drafter.zero_grad()
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = drafter(*args)
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}, sum(kept)


@pytest.mark.parametrize("family", FAMILIES)
def test_recomputed_layers_give_the_plain_gradients_and_keep_only_their_inputs(family):
    drafter, args = drafter_and_inputs(family)
    out, grads, kept = backward(drafter, args, recompute=False)
    out_r, grads_r, kept_r = backward(drafter, args, recompute=True)
    assert torch.equal(out_r, out)
    assert grads_r.keys() == grads.keys() and len(grads) > 10
    for name, g in grads.items():
        torch.testing.assert_close(grads_r[name], g, rtol=1e-12, atol=1e-14, msg=name)
    layer_input = args[1].numel() * args[1].element_size()
    # the layers' inputs and what lies outside the layers (the context's projection, the final norm)
    # are kept; each layer's attention and MLP activations are not
    assert kept_r < kept / 3, (kept_r, kept)
    assert kept_r >= drafter.config.num_hidden_layers * layer_input


@pytest.mark.slow(seconds=60)
@pytest.mark.parametrize("family", FAMILIES)
def test_recompute_through_compiled_layers(family):
    torch._dynamo.reset()
    drafter, args = drafter_and_inputs(family, torch.float32)
    out, grads, kept = backward(drafter, args, recompute=False)
    for layer in drafter.layers:
        layer.compile(dynamic=False)
    out_r, grads_r, kept_r = backward(drafter, args, recompute=True)
    torch.testing.assert_close(out_r, out, rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(grads_r[name], g, rtol=1e-4, atol=1e-5, msg=name)
    assert kept_r < kept / 3, (kept_r, kept)
    torch._dynamo.reset()

