"""The static cache's attention against a float64 brute force: packed GQA reads each K/V head once
and must give the attention of every query head over its own K/V head, under the per-row mask."""

import math

import pytest
import torch

from dflash_train.static_cache import PACK_MAX_QUERIES, causal_bias, packed_gqa_attention


def brute_force(query, key, value, bias, scale):
    q, k, v, b = (t.double() for t in (query, key, value, bias))
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for row in range(q.shape[0]):
        for head in range(q.shape[1]):
            kv = head // group  # query head h reads K/V head h // group (transformers' repeat_kv order)
            scores = q[row, head] @ k[row, kv].T * scale + b[row, 0]
            out[row, head] = torch.softmax(scores, -1) @ v[row, kv]
    return out.transpose(1, 2)


class _Module:  # what the attention function reads from a transformers attention module
    is_causal = True
    num_key_value_groups = 3


@pytest.mark.parametrize("queries", [1, 16, PACK_MAX_QUERIES + 1])  # decode, a verified block, a prefill
def test_packed_gqa_equals_brute_force(queries):
    g = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, dim, length = 3, 9, 3, 8, 96
    query = torch.randn(rows, heads, queries, dim, generator=g)
    key, value = (torch.randn(rows, kv_heads, length, dim, generator=g) for _ in range(2))
    # rows at different depths: positions start at 0, 7 and length - queries
    starts = torch.tensor([0, 7, length - queries])
    positions = starts[:, None] + torch.arange(queries)
    bias = causal_bias(positions, length, torch.float32)
    scale = 1 / math.sqrt(dim)
    out, _ = packed_gqa_attention(_Module(), query, key, value, bias, scaling=scale)
    assert out.shape == (rows, queries, heads, dim)
    torch.testing.assert_close(out.double(), brute_force(query, key, value, bias, scale), atol=1e-5, rtol=1e-5)
