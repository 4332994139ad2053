"""A target's KV cache the way a serving engine keeps it: preallocated, written at per-row positions.

Shared by the regeneration engine (generate/graphed_engine.py) and the speculative decoder
(eval/static_decode.py). Rows are independent: each writes its K/V at the positions it is given, a
query at position p sees the keys at positions <= p of its own row, and nothing is ever cropped, so
a stale K/V above a row's position is invisible and gets overwritten before it could be seen. The
shapes never change, so a decode step over all rows can be captured once as a CUDA graph.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer

ALIGN = 16
"""Cache lengths are rounded up to this: SDPA's memory-efficient kernel wants aligned mask rows."""


def static_cache_problem(model) -> str | None:
    """Why `model` cannot run with this cache, or None when it can."""
    config = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"transformers does not support a static cache for {name} (_can_compile_fullgraph is False)"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(config, "sliding_window", None):
        return f"{name} has {sorted(layer_types)} layers (sliding window {getattr(config, 'sliding_window', None)}); " \
               "the static cache holds full-attention layers only"
    if config._attn_implementation not in ("sdpa", "eager"):
        return f"attention '{config._attn_implementation}' ignores 4D masks (use sdpa or eager)"
    return None


class PositionedLayer(StaticLayer):
    """A StaticLayer that writes at `positions` [R, Q] (set before each forward) instead of its
    running length: per-row positions, rewritable."""

    positions: torch.Tensor

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        index = self.positions[:, None, :, None]
        self.keys.scatter_(2, index.expand_as(key_states), key_states)
        self.values.scatter_(2, index.expand_as(value_states), value_states)
        return self.keys, self.values


def positioned_cache(num_layers: int, length: int) -> Cache:
    """Allocated by the first forward through it (its batch size is that forward's)."""
    return Cache(layers=[PositionedLayer(length) for _ in range(num_layers)])


def causal_bias(positions: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [R, 1, Q, L]: query at position p sees cache positions <= p (eager adds it,
    SDPA takes it as is)."""
    keys = torch.arange(length, device=positions.device)
    visible = keys <= positions[:, None, :, None]
    return torch.zeros((), dtype=dtype, device=positions.device).masked_fill(~visible, torch.finfo(dtype).min)


def forward_at(model, cache: Cache, ids: torch.Tensor, positions: torch.Tensor, **kwargs):
    """The HF model's output for `ids` [R, Q] at `positions` [R, Q], their K/V written into `cache`."""
    for layer in cache.layers:
        layer.positions = positions
    length = cache.layers[0].max_cache_len
    dtype = model.get_input_embeddings().weight.dtype
    return model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                 attention_mask=causal_bias(positions, length, dtype), **kwargs)


def graphed(step, device: torch.device):
    """`step` captured as a CUDA graph (warmed up on a side stream first); returns its replay."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay
