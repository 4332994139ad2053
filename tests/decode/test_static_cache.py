"""The static cache's attention against a float64 brute force: packed GQA reads each K/V head once
and must give the attention of every query head over its own K/V head, under the per-row mask
(causal, or a sliding window's); and what the static cache still refuses, named."""

import math

import pytest
import torch
from tiny import tiny_target, tiny_windowed

from transformers import Gemma2Config, GptOssConfig
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

from dflash_train.decode.static_cache import PACK_MAX_QUERIES, packed_gqa_attention, position_masks, static_cache_problem


def brute_force(query, key, value, bias, scale, softcap=None, sinks=None):
    """Per row and head: softmax(scores + mask) @ V, scores soft-capped (c * tanh(s / c)) and a
    sink logit taking its share of the softmax while adding no value, where given."""
    q, k, v, b = (t.double() for t in (query, key, value, bias))
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for row in range(q.shape[0]):
        for head in range(q.shape[1]):
            kv = head // group  # query head h reads K/V head h // group (transformers' repeat_kv order)
            scores = q[row, head] @ k[row, kv].T * scale
            scores = scores if softcap is None else softcap * torch.tanh(scores / softcap)
            scores = scores + b[row, 0]
            if sinks is not None:
                scores = torch.cat([scores, sinks[head].double().expand(scores.shape[0], 1)], dim=1)
            p = torch.softmax(scores, -1)
            out[row, head] = p[:, : v.shape[2]] @ v[row, kv]
    return out.transpose(1, 2)


class _Module:  # what the attention function reads from a transformers attention module
    is_causal = True
    num_key_value_groups = 3


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("queries", [1, 16, PACK_MAX_QUERIES + 1])  # decode, a verified block, a prefill
def test_packed_gqa_equals_brute_force(queries, window):
    g = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, dim, length = 3, 9, 3, 8, 96
    query = torch.randn(rows, heads, queries, dim, generator=g)
    key, value = (torch.randn(rows, kv_heads, length, dim, generator=g) for _ in range(2))
    # rows at different depths: positions start at 0, 7 and length - queries
    starts = torch.tensor([0, 7, length - queries])
    positions = starts[:, None] + torch.arange(queries)
    bias = position_masks(positions, length, {"sliding_attention": window}, torch.float32)
    keys, at = torch.arange(length), positions[:, None, :, None]
    assert torch.equal(bias == 0, (keys <= at) & (keys > at - (window or length)))  # (p - window, p]
    scale = 1 / math.sqrt(dim)
    out, _ = packed_gqa_attention(_Module(), query, key, value, bias, scaling=scale)
    assert out.shape == (rows, queries, heads, dim)
    torch.testing.assert_close(out.double(), brute_force(query, key, value, bias, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_soft_capping_and_sinks_are_applied(family):
    """SDPA has neither: a module that passes them runs its model's eager attention, masks as given."""
    g = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, dim, length, queries = 2, 4, 2, 8, 24, 3
    shape = dict(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim, hidden_size=heads * dim)
    if family == "gemma2":
        module, kwargs = Gemma2Attention(Gemma2Config(**shape), 0), {"softcap": 0.5}
    else:
        module = GptOssAttention(GptOssConfig(**shape), 0)
        module.sinks.data = torch.randn(heads, generator=g)
        kwargs = {"s_aux": module.sinks}
    query = torch.randn(rows, heads, queries, dim, generator=g)
    key, value = (torch.randn(rows, kv_heads, length, dim, generator=g) for _ in range(2))
    positions = torch.tensor([[5, 6, 7], [12, 13, 14]])
    bias = position_masks(positions, length, {"sliding_attention": 4}, torch.float32)
    out, _ = packed_gqa_attention(module, query, key, value, bias, scaling=0.3, **kwargs)
    expected = brute_force(query, key, value, bias, 0.3, softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.double(), brute_force(query, key, value, bias, 0.3), atol=1e-3)  # they matter here

def test_what_the_static_cache_refuses_is_named():
    """Sliding windows are masks now; attention no mask can express is refused, one reason each."""
    assert [static_cache_problem(tiny_windowed(f).model) for f in ("mistral", "gemma3", "gpt_oss")] == [None] * 3
    model = tiny_target(num_layers=2).model
    config = model.config
    config.layer_types, config.attention_chunk_size = ["chunked_attention", "full_attention"], 8
    assert "layer types ['chunked_attention']" in static_cache_problem(model)
    config.layer_types = ["full_attention"] * 2
    config.use_bidirectional_attention = True
    assert "bidirectional" in static_cache_problem(model)
    config.use_bidirectional_attention = False
    config._attn_implementation = "flash_attention_2"
    assert "ignores 4D masks" in static_cache_problem(model)
