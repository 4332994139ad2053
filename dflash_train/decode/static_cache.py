"""A target's KV cache the way a serving engine keeps it: preallocated, written at per-row positions.

Shared by the regeneration engine (decode/graphed_engine.py) and the speculative decoder
(decode/static_decode.py). Rows are independent: each writes its K/V at the positions it is given, a
query at position p sees the keys at positions <= p of its own row (in a sliding-window layer only
those in (p - window, p]: every layer's cache is full length, windows are masks, windows.py), and
nothing is ever cropped, so a stale K/V above a row's position is invisible and gets overwritten
before it could be seen. The shapes never change, so a decode step over all rows can be captured
once as a CUDA graph. Attention sinks (gpt-oss) and logit soft-capping (Gemma 2) go through the
model's own eager attention, under the same masks (`packed_gqa_attention`).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dflash_train.decode.flex_decode import FLEX_DECODE, decode_block_mask
from dflash_train.decode.windows import layer_windows, window_masks, windows_problem

ALIGN = 16
"""Cache lengths are rounded up to this: SDPA's memory-efficient kernel wants aligned mask rows."""


def static_cache_problem(model) -> str | None:
    """Why `model` cannot run with this cache, or None when it can."""
    config = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"transformers does not support a static cache for {name} (_can_compile_fullgraph is False)"
    problem = windows_problem(config)
    if problem:
        return f"{name}: {problem}"
    if config._attn_implementation not in ("sdpa", "eager"):
        return f"attention '{config._attn_implementation}' ignores 4D masks (use sdpa or eager)"
    return None


def write_at(buffer: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, states: torch.Tensor) -> None:
    """buffer[r, :, positions[r, q]] = states[r, :, q] for buffer [R, heads, L, D], states [R, heads,
    Q, D], rows = arange(R)[:, None]. An index_put, not a scatter: a compiled step (inductor) updates
    its input in place under index_put, but a scattered one it copies whole, the entire cache, every step."""
    buffer[rows, :, positions] = states.transpose(1, 2)


class PositionedLayer(StaticLayer):
    """A StaticLayer that writes at `positions` [R, Q] (set before each forward) instead of its
    running length: per-row positions, rewritable."""

    positions: torch.Tensor

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self.rows = torch.arange(key_states.shape[0], device=key_states.device)[:, None]

    def hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Initialised over `keys` and `values` [R, heads, L, dim] held elsewhere (views of a shared
        buffer), not buffers of its own."""
        self.device = keys.device
        self.batch_size, self.num_heads = keys.shape[:2]
        self.k_head_dim, self.v_head_dim = keys.shape[-1], values.shape[-1]
        self.keys, self.values = keys, values
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.rows = torch.arange(keys.shape[0], device=keys.device)[:, None]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        write_at(self.keys, self.rows, self.positions, key_states)
        write_at(self.values, self.rows, self.positions, value_states)
        return self.keys, self.values


class PositionedCache(Cache):
    """A full-length PositionedLayer for every layer of `config`'s model, sliding ones included,
    and the windows of its layer types (`windows`, read once here: `forward_at` masks with them).
    Allocated by the first forward through it (its batch size is that forward's)."""

    def __init__(self, config, length: int):
        super().__init__(layers=[PositionedLayer(length) for _ in range(config.num_hidden_layers)])
        self.windows = layer_windows(config)


def position_masks(positions: torch.Tensor, length: int, windows: dict[str, int | None], dtype: torch.dtype):
    """The masks of a forward at `positions` [R, Q] over cache positions 0..length-1: a query at
    position p sees those <= p, a sliding layer's only the window below it (windows.window_masks)."""
    keys = torch.arange(length, device=positions.device)
    return window_masks(keys <= positions[..., None], positions, keys, windows, dtype)


OWN_ATTENTION_KWARGS = ("s_aux", "softcap")
"""What an attention module may pass beyond plain attention: sinks (gpt-oss and others) and logit
soft-capping (Gemma 2). SDPA applies neither (transformers' SDPA drops sinks and refuses
soft-capping), so such a module runs its model's own eager attention, which applies them."""

PACKED_GQA = "dflash_packed_gqa"
PACK_MAX_QUERIES = 64
"""Decode steps and verification blocks are packed; a prefill is bound by compute, not by reading
the cache, and keeps transformers' SDPA path."""


def packed_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA that reads each K/V head once. Given a mask, transformers' SDPA path (up to 5.17) repeats
    every K/V head for each query head of its group, which for SmolLM2 (9 query, 3 K/V heads)
    triples the cache traffic of a decode step, the step's main cost at large batches, and lands in
    SDPA's math kernel. Here the group's query heads become extra query rows of their K/V head, with
    the mask repeated for them: the same attention, one read of the cache by the efficient kernel.
    A module with sinks or soft-capping (OWN_ATTENTION_KWARGS) gets its model's eager attention."""
    if any(kwargs.get(name) is not None for name in OWN_ATTENTION_KWARGS):
        eager = sys.modules[type(module).__module__].eager_attention_forward  # the one its `eager` runs
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    rows, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    if group == 1 or queries > PACK_MAX_QUERIES or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    query = query.reshape(rows, kv_heads, group * queries, dim)  # head h = kv * group + g: rows (g, q)
    mask = attention_mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(attention_mask.shape[0], 1, group * queries, -1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(rows, heads, queries, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_GQA, packed_gqa_attention)
AttentionMaskInterface.register(PACKED_GQA, sdpa_mask)  # masks come built (position_masks); never called


@contextmanager
def attention_as(model, implementation: str):
    """The model's attention is `implementation` inside the block (and in graphs captured there).
    Already set, nothing is written: a compiled step run inside the block then changes no config
    (dynamo may not replay a restore that follows a flex_attention call; the engine sets it outside)."""
    config = model.config.get_text_config(decoder=True)
    before = config._attn_implementation
    if before == implementation:
        yield
        return
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = before


def forward_at(model, cache: PositionedCache, ids: torch.Tensor, positions: torch.Tensor, flex: bool = False,
               **kwargs):
    """The HF model's output for `ids` [R, Q] at `positions` [R, Q], their K/V written into `cache`.
    `flex`: attention reads each row only up to its position (flex_decode.py: compiled steps of
    full-attention models); else packed SDPA under a mask over the whole cache."""
    for layer in cache.layers:
        layer.positions = positions
    length = cache.layers[0].max_cache_len
    if flex:
        config = model.config.get_text_config(decoder=True)
        mask = decode_block_mask(positions, length, config.num_attention_heads // config.num_key_value_heads)
    else:
        mask = position_masks(positions, length, cache.windows, model.get_input_embeddings().weight.dtype)
    with attention_as(model, FLEX_DECODE if flex else PACKED_GQA):
        return model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                     attention_mask=mask, **kwargs)
