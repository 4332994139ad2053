"""Sliding-window layers as masks over full-length caches, for the fast decode paths.

The static caches (static_cache.py) and the ragged cache (decode/ragged_cache.py) keep every layer's
K/V at full length, whatever its window, so one cache layout, one write and one gather serve every
layer. A sliding layer's window is then only a mask: a query at position p sees the keys at
positions in (p - w, p]. That is transformers' `sliding_window_overlay`, used here as it is, so the
convention is the one each family's own (cache-free) forward applies through
`create_sliding_window_causal_mask` on `config.sliding_window`.

A model takes one prepared 4D mask for all its layers; one with several layer types in its config
(Gemma 2 and 3, gpt-oss, Qwen2/3 with `use_sliding_window`) takes a dict from layer type to mask.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import sliding_window_overlay

MASKED_LAYER_TYPES = ("full_attention", "sliding_attention")


def _layers(config) -> tuple[list[str], list[int | None]]:
    """Each decoder layer's type and window (None: full), as transformers derives them for its own
    caches: `layer_types`, else a `sliding_window` on every layer (Mistral). Read from the config
    itself: transformers' helper for this changed its return type between 5.17 and 5.24."""
    text = config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    types = list(getattr(text, "layer_types", None) or
                 ["sliding_attention" if window else "full_attention"] * text.num_hidden_layers)
    return types, [window if t == "sliding_attention" else None for t in types]


def windows_problem(config) -> str | None:
    """Why the layers' attention is more than a mask over a full-length cache, or None."""
    text = config.get_text_config(decoder=True)
    if not getattr(text, "is_causal", True) or getattr(text, "use_bidirectional_attention", False):
        return "bidirectional attention: the masks here are causal"
    types, windows = _layers(config)
    others = sorted(set(types) - set(MASKED_LAYER_TYPES))
    if others:
        return f"layer types {others} (only {list(MASKED_LAYER_TYPES)} are masks over a full cache)"
    if len({w for t, w in zip(types, windows) if t == "sliding_attention"}) > 1:
        return f"sliding layers of different windows {sorted(set(windows) - {None})}: one mask per layer type"
    return None


def plain_causal_problem(model) -> str | None:
    """Why `model`'s attention is more than each query seeing every key at or before its position:
    sliding windows, logit soft-capping or attention sinks; None when it is not."""
    config = model.config.get_text_config(decoder=True)
    windows = {w for w in layer_windows(config).values() if w is not None}
    if windows:
        return f"sliding-window layers (window {sorted(windows)})"
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    if any(name.endswith("sinks") for name, _ in model.named_parameters()):
        return "attention sinks"
    return None


def layer_windows(config) -> dict[str, int | None]:
    """{layer type: its window (None: full attention)} for the types `config`'s layers have."""
    return dict(zip(*_layers(config)))


def window_masks(visible: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                 windows: dict[str, int | None], dtype: torch.dtype):
    """The `attention_mask` of a forward: additive masks [R, 1, Q, K] (eager adds them, SDPA takes
    them as they are) from the keys `visible` [R, Q, K] to each query, narrowed in a sliding layer
    to its window. Positions: queries [R, Q], keys [R, K] or [K]. One mask when every layer sees
    the same keys, else {layer type: mask}."""
    masks = {}
    for kind, window in windows.items():
        seen = visible
        if window is not None:
            seen = seen & sliding_window_overlay(window)(None, None, query_positions[..., :, None],
                                                         key_positions[..., None, :])
        masks[kind] = torch.zeros((), dtype=dtype, device=seen.device).masked_fill(~seen[:, None], torch.finfo(dtype).min)
    return next(iter(masks.values())) if len(masks) == 1 else masks
