"""The target's KV cache for many rows decoded in lockstep, each at its own length.

Batched speculative decoding verifies one block per row per round, but rows accept different
numbers of tokens. Re-running the target over every row's whole sequence each round (the
cache-free path) costs rounds x sequence length of target compute; with this cache a round costs
the block alone. The layout keeps one invariant: column c of row r holds position c, for c below
the row's `start` (its next block's first position); columns past it are padding. A round appends
the block at the end of every row (columns W..W+B-1) and the mask lets each row's block see its
own cached positions and, causally, itself. Once accepted counts are known, `advance` moves each
row's kept block columns down to their positions and drops finished rows: one gather per layer,
the copy transformers' dynamic cache already makes each round when it appends.

Rows carry explicit positions, so RoPE sees the same positions as in an unpadded decode. Every
layer keeps every column, sliding-window layers too: their window is a mask over each row's
positions (windows.py), so one layout and one gather serve all layers. Attention sinks (gpt-oss)
and soft-capping (Gemma 2) need nothing here: the target runs its own eager attention, which applies
them under these masks. Eager or SDPA attention takes custom masks this way; `RaggedCache.supports`
names what does not, and the caller falls back.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from dflash_train.targets.model import Target
from dflash_train.decode.windows import layer_windows, window_masks, windows_problem

MASKABLE_ATTENTION = ("eager", "sdpa")
"""Attention implementations that apply a custom 4D additive mask as given."""


class RaggedCache:
    def __init__(self, target: Target, layer_ids: list[int]):
        self.target, self.layer_ids = target, layer_ids
        self.cache = DynamicCache()  # no config: a plain, uncropped DynamicLayer for every layer
        self.windows = layer_windows(target.model.config)
        self.starts: torch.Tensor | None = None  # [R] each row's next block position = its cached length
        self.block_at = 0  # the column where the last `extend` put its block

    @staticmethod
    def supports(target: Target) -> str | None:
        """None when the target can decode through a ragged cache, else why not."""
        config = target.model.config
        attn = getattr(config, "_attn_implementation", None)
        if attn not in MASKABLE_ATTENTION:
            return f"attention implementation {attn!r} takes no custom 4D mask (needs one of {MASKABLE_ATTENTION})"
        return windows_problem(config)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, key_positions: torch.Tensor):
        """Final-normed hidden states [R, T, H] and features [R, T, K*H] of `ids` at `positions`,
        each query seeing the key columns `visible` [R, T, W+T] marks (in a sliding layer, those of
        them in its window: the columns hold `key_positions` [R, W+T])."""
        mask = window_masks(visible, positions, key_positions, self.windows, self.target.embed_weight.dtype)
        with self.target.capture(self.layer_ids) as store:
            hidden = self.target.model.get_decoder()(
                input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=self.cache,
                use_cache=True,
            ).last_hidden_state
        return hidden, torch.cat([store[i] for i in self.layer_ids], dim=-1)

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor):
        """Right-padded prompts [R, P] of `lengths`: hidden states and features of every column
        (padding included, never read); the rows' starts become their lengths."""
        rows, width = ids.shape
        col = torch.arange(width, device=ids.device)
        visible = (col[None, :] <= col[:, None])[None] & (col < lengths[:, None])[:, None, :]
        visible |= torch.eye(width, dtype=torch.bool, device=ids.device)[None]  # a padding query sees itself
        self.starts = lengths.clone()
        positions = col.expand(rows, width)
        return self._forward(ids, positions, visible, positions)

    def extend(self, block: torch.Tensor):
        """Block tokens [R, B] at each row's positions start..start+B-1: hidden states and features."""
        rows, size = block.shape
        width = self.block_at = self.cache.get_seq_length()
        offsets = torch.arange(size, device=block.device)
        cached = torch.arange(width, device=block.device)[None, None, :] < self.starts[:, None, None]
        causal = (offsets[None, :] <= offsets[:, None]).expand(rows, size, size)
        visible = torch.cat([cached.expand(rows, size, width), causal], dim=2)
        positions = self.starts[:, None] + offsets
        key_positions = torch.cat([torch.arange(width, device=block.device).expand(rows, width), positions], dim=1)
        return self._forward(block, positions, visible, key_positions)

    def advance(self, kept: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """After `extend`: keep the first kept[r] block columns of each row (slot 0 and the accepted
        proposals), then only `rows`. Returns the gather index [len(rows), max new start] that did
        it, for `RaggedDraftCache.reindex`. After `prefill`, kept = 0 selects rows only."""
        starts, new_starts = self.starts[rows], self.starts[rows] + kept[rows]
        col = torch.arange(int(new_starts.max()), device=kept.device)[None, :]
        index = torch.where(col < starts[:, None], col, self.block_at + col - starts[:, None])
        index = torch.where(col < new_starts[:, None], index, torch.zeros_like(index))  # padding: any column
        for layer in self.cache.layers:
            layer.keys = _take(layer.keys[rows], index)
            layer.values = _take(layer.values[rows], index)
        self.starts = new_starts
        return index


class RaggedDraftCache:
    """The drafter's context keys/values in `RaggedCache`'s layout: the `cache` of DFlashAttention.

    Each draft forward brings the context it has not seen: the prompt's features in the first
    round, the last block's (every slot, rejected ones too) afterwards. Their keys/values land
    after the cached columns, and the target's last gather index moves the kept ones into
    place, so the drafter projects each context position once instead of every round.
    """

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.rows = self.index = None

    def reindex(self, rows: torch.Tensor, index: torch.Tensor) -> None:
        """The rows and gather index of the target cache's last `advance`, for the next extend."""
        self.rows, self.index = rows, index

    def extend(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """New context keys/values [R, heads, C, d] of the kept rows -> the layer's whole context."""
        if self.k[layer] is not None:
            k_new = torch.cat([self.k[layer][self.rows], k_new], dim=2)
            v_new = torch.cat([self.v[layer][self.rows], v_new], dim=2)
        self.k[layer], self.v[layer] = _take(k_new, self.index), _take(v_new, self.index)
        return self.k[layer], self.v[layer]


def _take(kv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """kv [R, heads, W, d] -> [R, heads, w, d]: row r's columns index[r]."""
    return kv.gather(2, index[:, None, :, None].expand(-1, kv.shape[1], -1, kv.shape[3]))
