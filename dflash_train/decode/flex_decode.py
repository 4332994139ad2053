"""Decode attention that reads each row's cache only up to the row's own position.

The static cache (static_cache.py) is as long as the longest prompt plus the answer budget, and
SDPA under a mask reads every position of it for every row: at a thousand rows, 1,280 positions
and ~330-token answers, most of a regeneration step's cache traffic is K/V no query can see.
flex_attention takes a block mask instead: per row, how many 64-position KV blocks hold keys at or
below the row's position (`decode_block_mask`); blocks past them are never read. The blocks below
every query's position are "full" (nothing to hide: the kernel skips the mask_mod there); in the
last one or two a mask_mod hides the keys above each query's position. Inductor lowers it to its flex-decoding
kernel, so this path is for compiled steps (eagerly, flex_attention computes densely: correct,
for tests, not fast).

Grouped-query attention is packed as in `static_cache.packed_gqa_attention`: a group's query heads
become extra query rows of their K/V head, so each K/V block is read once, and the kernel sees one
query head per K/V head (flex decoding wants a power-of-two group; SmolLM2's is 3).
Full-attention layers only: sliding windows, attention sinks and soft-capping keep the SDPA path
(`flex_decode_problem` says which).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dflash_train.decode.windows import plain_causal_problem

FLEX_DECODE = "dflash_flex_decode"
KV_BLOCK = 64
"""Positions per KV block of the mask, the unit a row's read grows by: a row reads half a block past
its position on average, so half flex_attention's default block of 128 reads ~32 positions less
per row and layer (the kernel's own BLOCK_N shrinks to fit: inductor's flex_decoding)."""
MIN_HEAD_DIM = 16
"""Inductor's flex kernels need head dimensions of at least 16."""
KERNEL_OPTIONS: dict = {}
"""Passed to flex_attention as `kernel_options` (BLOCK_N, num_warps, num_stages...): inductor's
defaults unless set; read when the step is compiled (bench/regen_speed.py --flex-options). A BLOCK_N
set here must divide KV_BLOCK (inductor shrinks only its own default to fit)."""


def flex_decode_problem(model) -> str | None:
    """Why `model`'s attention is more than causal attention over a full-length cache, or None."""
    problem = plain_causal_problem(model)
    if problem:
        return problem
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim < MIN_HEAD_DIM:
        return f"head_dim {head_dim} < {MIN_HEAD_DIM}"
    return None


def decode_block_mask(positions: torch.Tensor, length: int, group: int) -> BlockMask:
    """The block mask of queries at `positions` [R, Q] over cache positions 0..length-1 (a multiple
    of KV_BLOCK), for the packed layout: query row i of a K/V head is query i % Q of its row.
    A query at position p sees the keys at positions <= p; a row reads blocks 0..max(p) // KV_BLOCK,
    of which those wholly at or below min(p) are full (read without the mask_mod)."""
    if length % KV_BLOCK:
        raise ValueError(f"a flex-decoding cache is a whole number of {KV_BLOCK}-position blocks, not {length}")
    rows, queries = positions.shape
    blocks = length // KV_BLOCK
    reach = (positions.amax(-1) // KV_BLOCK + 1).to(torch.int32)
    full = ((positions.amin(-1) + 1) // KV_BLOCK).to(torch.int32)  # block b is full when (b + 1) * KV_BLOCK - 1 <= min(p)
    indices = torch.arange(blocks, dtype=torch.int32, device=positions.device)
    partial = (full[:, None] + indices).clamp_(max=blocks - 1)  # the first reach - full of them are read

    def visible(row, head, query, key):
        return key <= positions[row, query % queries]

    # Contiguous full-block indices: an expanded view of one row's gave inductor's flex-decoding
    # kernel wrong attention and illegal memory accesses (torch 2.11, H200; eager was right).
    return BlockMask.from_kv_blocks(
        (reach - full).view(rows, 1, 1), partial.view(rows, 1, 1, blocks), full.view(rows, 1, 1),
        indices.expand(rows, 1, 1, blocks).contiguous(), BLOCK_SIZE=KV_BLOCK, mask_mod=visible,
        seq_lengths=(group * queries, length), compute_q_blocks=False)


def flex_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`query` [R, H, Q, D] against the cache `key`/`value` [R, Hkv, L, D] under the BlockMask
    `attention_mask` (decode_block_mask, built for this group size), the group packed into rows."""
    rows, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    packed = query.reshape(rows, kv_heads, heads // kv_heads * queries, dim)  # head h = kv * group + g
    out = flex_attention(packed, key, value, block_mask=attention_mask, scale=scaling,
                         kernel_options=KERNEL_OPTIONS or None)
    return out.reshape(rows, heads, queries, -1).transpose(1, 2).contiguous(), None


AttentionInterface.register(FLEX_DECODE, flex_decode_attention)
AttentionMaskInterface.register(FLEX_DECODE, sdpa_mask)  # masks come built (decode_block_mask); never called
