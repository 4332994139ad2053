"""On CUDA: compiled flex_attention == SDPA with the dense mask, forward and gradients.

On a GPU host: `python -m pytest tests/gpu -m gpu`. Imports only the draft package
(no pydantic / transformers needed on the GPU host).
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.draft import masks
from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig

from draft.test_masks import sample_anchors  # tests/ is on sys.path (conftest.py)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

T, N, BS = 512, 64, 16


HEADS = {"default": (8, 2, 32), "gemma3": (4, 1, 256)}
"""(query heads, K/V heads, head size): a drafter takes its target's; Gemma 3 270M's heads are 256 wide."""


def drafter(heads: str = "default") -> DFlashDraftModel:
    torch.manual_seed(0)
    q_heads, kv_heads, head_dim = HEADS[heads]
    cfg = DraftModelConfig(
        hidden_size=256, num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=512, num_hidden_layers=2, vocab_size=1000, block_size=BS, target_layer_ids=[1, 3, 5], num_target_layers=8,
        mask_token_id=999,
    )
    return DFlashDraftModel(cfg).cuda()


def batch():
    gen = torch.Generator().manual_seed(1)
    loss_mask = torch.zeros(2, T, dtype=torch.long)
    loss_mask[0, 40:] = 1
    loss_mask[1, 100:130] = 1  # few eligible positions: padded (invalid) anchors in row 1
    anchors, valid = sample_anchors(loss_mask, N, gen)
    assert not valid[1].all()
    ctx = torch.randn(2, T, 3 * 256, generator=gen)
    emb = torch.randn(2, N * BS, 256, generator=gen)
    probe = torch.randn(2, N * BS, 256, generator=gen)
    return anchors.cuda(), ctx.cuda(), emb.cuda(), probe.cuda()


def run(model, anchors, ctx, emb, probe, use_flex, dtype):
    model.zero_grad(set_to_none=True)
    ctx_pos = torch.arange(T, device="cuda").expand(2, T)
    blk_pos = masks.block_positions(anchors, BS)
    if use_flex:
        mask = masks.flex_block_mask(anchors, BS, T)
    else:
        mask = masks.dense_mask(anchors, BS, T)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out = model(ctx, emb, ctx_pos, blk_pos, mask)
    (out.float() * probe).sum().backward()
    return out.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_flex_compiled_equals_sdpa_dense_forward_and_grads(dtype, tol, heads):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = drafter(heads)
    data = batch()
    out_f, grads_f = run(model, *data, use_flex=True, dtype=dtype)
    out_d, grads_d = run(model, *data, use_flex=False, dtype=dtype)
    assert torch.isfinite(out_f).all()
    assert rel_err(out_f, out_d) < tol, rel_err(out_f, out_d)
    for name in grads_d:
        assert rel_err(grads_f[name], grads_d[name]) < tol, (name, rel_err(grads_f[name], grads_d[name]))


def test_flex_mask_materialised_on_cuda_equals_dense():
    from torch.nn.attention.flex_attention import create_mask

    anchors = batch()[0]
    q = N * BS
    flex = create_mask(masks.mask_mod_for(anchors, BS, T), 2, None, q, T + q, device="cuda")
    assert torch.equal(flex.expand(2, 1, q, T + q), masks.dense_mask(anchors, BS, T))
