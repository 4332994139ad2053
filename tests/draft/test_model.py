"""The drafter: flex == SDPA, information flow of the mask, checkpoint names, KV cache, RoPE."""

from __future__ import annotations

import warnings

import pytest
import torch

from dflash_train.draft import masks
from dflash_train.draft.model import DraftKVCache, default_target_layer_ids
from draft.helpers_draft import tiny_draft_config, tiny_drafter

T = 18


def inputs(drafter, anchors, seed=0, t=T):
    d = drafter.config
    gen = torch.Generator().manual_seed(seed)
    b, n = anchors.shape
    ctx = torch.randn(b, t, len(d.target_layer_ids) * d.hidden_size, generator=gen)
    emb = torch.randn(b, n * d.block_size, d.hidden_size, generator=gen)
    ctx_pos = torch.arange(t).expand(b, t)
    blk_pos = masks.block_positions(anchors, d.block_size)
    return ctx, emb, ctx_pos, blk_pos


@torch.no_grad()
def test_flex_equals_sdpa_dense_on_cpu():
    drafter = tiny_drafter(seed=1)
    anchors = torch.tensor([[1, 6, 11], [3, 0, 0]])
    ctx, emb, cp, bp = inputs(drafter, anchors)
    dense = drafter(ctx, emb, cp, bp, masks.dense_mask(anchors, 4, T))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        flex = drafter(ctx, emb, cp, bp, masks.flex_block_mask(anchors, 4, T))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def block(out, j, bs=4):
    return out[:, j * bs : (j + 1) * bs]


@torch.no_grad()
def test_information_flow_follows_the_mask():
    drafter = tiny_drafter(seed=2, num_hidden_layers=3)
    anchors = torch.tensor([[4, 9, 13]])
    ctx, emb, cp, bp = inputs(drafter, anchors)
    mask = masks.dense_mask(anchors, 4, T)
    base = drafter(ctx, emb, cp, bp, mask)
    for j, a in enumerate(anchors[0].tolist()):
        later = ctx.clone()
        later[:, a:] += 10 * torch.randn_like(later[:, a:])
        torch.testing.assert_close(block(drafter(later, emb, cp, bp, mask), j), block(base, j), rtol=0, atol=1e-6)
        before = ctx.clone()
        before[:, a - 1] += 1.0
        assert (block(drafter(before, emb, cp, bp, mask), j) - block(base, j)).abs().max() > 1e-4, (
            f"block {j} must see context position a_j - 1 = {a - 1}"
        )
    # Another block's tokens never leak in; its own tokens do (bidirectional inside the block).
    other = emb.clone()
    other[:, 4:8] += 1.0  # block 1
    out = drafter(ctx, other, cp, bp, mask)
    torch.testing.assert_close(block(out, 0), block(base, 0), rtol=0, atol=1e-6)
    torch.testing.assert_close(block(out, 2), block(base, 2), rtol=0, atol=1e-6)
    last_slot = emb.clone()
    last_slot[:, 7] += 1.0  # slot 3 of block 1 influences slot 0 of block 1
    assert (drafter(ctx, last_slot, cp, bp, mask)[:, 4] - base[:, 4]).abs().max() > 1e-4


def expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {
        "fc.weight": (h, len(cfg.target_layer_ids) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return shapes


@pytest.mark.parametrize("num_layers,layer_ids", [(1, [2]), (3, [0, 1, 3])])
def test_state_dict_names_and_shapes_are_exactly_the_export_format(num_layers, layer_ids):
    drafter = tiny_drafter(num_hidden_layers=num_layers, target_layer_ids=layer_ids)
    got = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    assert got == expected_shapes(drafter.config)
    assert not any("embed" in k or "lm_head" in k for k in got)


@torch.no_grad()
def test_kv_cache_in_two_pieces_equals_one_full_forward():
    drafter = tiny_drafter(seed=4)
    c = 11
    anchors = torch.tensor([[c]])  # the block follows the whole context, as at inference
    ctx, emb, cp, bp = inputs(drafter, anchors, t=c)
    full = drafter(ctx, emb, cp, bp, masks.dense_mask(anchors, 4, c))
    cache = DraftKVCache(drafter.config.num_hidden_layers)
    first = drafter(ctx[:, :6], emb, cp[:, :6], bp, None, cache)
    assert cache.length == 6
    second = drafter(ctx[:, 6:], emb, cp[:, 6:], bp, None, cache)
    assert cache.length == c
    torch.testing.assert_close(second, full, rtol=1e-5, atol=1e-5)
    assert (first - full).abs().max() > 1e-4, "the first call saw only part of the context"
    # mask=None without a cache is the same "see everything" rule
    torch.testing.assert_close(drafter(ctx, emb, cp, bp, None), full, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_rope_only_relative_positions_matter():
    drafter = tiny_drafter(seed=5)
    anchors = torch.tensor([[3, 8, 12]])
    ctx, emb, cp, bp = inputs(drafter, anchors)
    mask = masks.dense_mask(anchors, 4, T)
    base = drafter(ctx, emb, cp, bp, mask)
    shifted = drafter(ctx, emb, cp + 37, bp + 37, mask)
    torch.testing.assert_close(shifted, base, rtol=1e-4, atol=1e-4)
    # ...and positions do matter: shifting the block alone changes the output
    assert (drafter(ctx, emb, cp, bp + 3, mask) - base).abs().max() > 1e-4


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(30, 2) == [1, 27]


def test_config_rejects_bad_layer_ids_and_mask_token():
    with pytest.raises(ValueError, match="target_layer_ids"):
        tiny_draft_config(target_layer_ids=[0, 4])
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_draft_config(mask_token_id=61)


def test_a_window_is_one_for_every_layer():
    cfg = tiny_draft_config(sliding_window=8)
    assert cfg.layer_types == ["sliding_attention"] * cfg.num_hidden_layers
    with pytest.raises(ValueError, match="one window for all layers"):
        tiny_draft_config(sliding_window=8, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="one window for all layers"):
        tiny_draft_config(layer_types=["sliding_attention"] * 2)
    with pytest.raises(ValueError, match="shorter than a block"):
        tiny_draft_config(sliding_window=2)
