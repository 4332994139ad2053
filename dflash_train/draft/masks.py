"""Anchors, labels and attention masks of the DFlash training objective.

Layout of one training sequence (length T, N anchors, block size B):
  keys    = [context positions 0..T-1 ; block tokens (anchor j, slot k) at index T + j*B + k]
  queries = the N*B block tokens
Block j is `[token[a_j], MASK x (B-1)]` at positions a_j .. a_j+B-1; slot k (>= 1) predicts
token[a_j + k]. A query of block j sees context keys with position STRICTLY below a_j (at inference
the target has not yet run on the anchor token, so its features do not exist) and every key of its
own block (bidirectional), never another block. With a sliding window W (`draft.sliding_window`),
as llama.cpp masks it (docs/design.md#the-drafters-context-window): a query at position p sees no key
at a position k with p - k >= W, so slot k of block j sees the context in (a_j + k - W, a_j); a window
is at least a block long, so a block always sees itself whole. Everything mask-related lives in this
file so the dense (CPU) and flex (GPU) paths and the decoders cannot drift apart.
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention.flex_attention import BlockMask

TILE = 128
"""flex_attention's sparse block (its default BLOCK_SIZE): the kernels skip or mask whole tiles."""


def upload(host: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor on `device` without a host sync: a pageable `.to(cuda)` waits for the copy,
    a page-locked one with non_blocking does not."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def anchor_keys(shape: tuple[int, int], generator: torch.Generator | None = None) -> torch.Tensor:
    """The random keys [b, T] that pick a batch's anchors, drawn on CPU: the same anchors on every device."""
    return torch.rand(*shape, generator=generator, device="cpu")


def anchors_from_keys(loss_mask: torch.Tensor, keys: torch.Tensor, num_anchors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchor positions inside responses, up to `num_anchors` per sequence, picked by the keys
    [b, T] (`anchor_keys`, on the mask's device): device work only, so a CUDA graph can replay it.

    An anchor i needs loss_mask[i] and loss_mask[i+1]: the block starts on a response token and
    has at least one response token to predict. Returns (anchors [b, N] sorted, padded with 0;
    valid [b, N] bool). Padded anchors sit at position 0, so they see no context.
    """
    b, t = loss_mask.shape
    lm = loss_mask.bool()
    eligible = torch.zeros_like(lm)
    eligible[:, :-1] = lm[:, :-1] & lm[:, 1:]
    # Ineligible positions get +inf so a sort puts eligible ones first, in random order.
    keys = keys.masked_fill(~eligible, math.inf)
    n = min(num_anchors, t)
    picked = keys.argsort(dim=1)[:, :n]
    valid = eligible.gather(1, picked)
    anchors = torch.where(valid, picked, torch.zeros_like(picked))
    # Sort valid anchors ascending, padding last (keeps blocks in position order, as at inference).
    order_key = torch.where(valid, anchors, torch.full_like(anchors, t + 1))
    order = order_key.argsort(dim=1)
    anchors, valid = anchors.gather(1, order), valid.gather(1, order)
    if n < num_anchors:
        pad = num_anchors - n
        anchors = torch.cat([anchors, anchors.new_zeros(b, pad)], dim=1)
        valid = torch.cat([valid, valid.new_zeros(b, pad)], dim=1)
    return anchors, valid


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, N] anchors -> [b, N*B] absolute positions a_j + k of the block tokens."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[:, :, None] + offsets).flatten(1)


def label_source_positions(anchors: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """[b, N*B] position whose next-token prediction is each slot's label: a + k - 1 for slot k (the
    target reads token[a+k-1] and predicts token[a+k]); clamped into the sequence, where slots that do
    not count (slot 0, past the end) read any valid position."""
    return (block_positions(anchors, block_size) - 1).clamp(min=0, max=seq_len - 1)


def block_inputs(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> torch.Tensor:
    """Block token ids [b, N*B]: the anchor's own token in slot 0, MASK in the others."""
    ids = torch.full(
        (*anchors.shape, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device
    )
    ids[:, :, 0] = input_ids.gather(1, anchors)
    return ids.flatten(1)


def true_predecessors(block_ids: torch.Tensor, labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each block slot's true previous token [b, N*B]: the block's given token for slot 1, the label
    before it for the others (slot 0 carries no loss). What a family whose slots draft one after the
    other is conditioned on in training: a round's later slots count only while the earlier ones were
    right, and then their previous tokens are the true ones."""
    slot = torch.arange(labels.shape[1], device=labels.device) % block_size
    return torch.where(slot == 1, block_ids.roll(1, 1), labels.roll(1, 1)).clamp(min=0)


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and loss weights [b, N*B] for every block slot.

    Slot k predicts token[a + k]; it counts when k >= 1, the block is valid, a + k is inside the
    sequence and a response token. Weight w_k = exp(-(k-1)/gamma): early slots matter most since
    acceptance stops at the first miss.
    """
    t = input_ids.shape[1]
    pos = block_positions(anchors, block_size)  # [b, N*B]
    inside = pos < t
    pos_c = pos.clamp(max=t - 1)
    labels = input_ids.gather(1, pos_c)
    k = torch.arange(block_size, device=input_ids.device).repeat(anchors.shape[1])
    decay = torch.exp(-(k - 1).clamp(min=0).double() / gamma).to(torch.float32)
    counted = (
        (k >= 1)[None, :]
        & inside
        & loss_mask.bool().gather(1, pos_c)
        & valid.repeat_interleave(block_size, dim=1)
    )
    # A Python 0.0, not a 0-dim CPU tensor: moving that one to the GPU is a host sync (seen on the H200).
    weights = torch.where(counted, decay[None, :], 0.0)
    return labels, weights


def _check_window(window: int | None, block_size: int) -> None:
    assert window is None or window >= block_size, f"window {window} shorter than a block of {block_size}"


def dense_mask(anchors: torch.Tensor, block_size: int, context_len: int, window: int | None = None) -> torch.Tensor:
    """Bool mask [b, 1, N*B, T + N*B] (True = attend) for SDPA."""
    _check_window(window, block_size)
    b, n = anchors.shape
    q = n * block_size
    q_block = torch.arange(q, device=anchors.device) // block_size  # [Q]
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, Q]
    ctx = torch.arange(context_len, device=anchors.device)
    sees_ctx = ctx[None, None, :] < q_anchor[:, :, None]  # [b, Q, T]
    if window is not None:
        q_pos = q_anchor + torch.arange(q, device=anchors.device) % block_size
        sees_ctx &= q_pos[:, :, None] - ctx[None, None, :] < window
    sees_block = (q_block[:, None] == q_block[None, :]).expand(b, q, q)  # [b, Q, Q]
    return torch.cat([sees_ctx, sees_block], dim=2)[:, None]


def mask_mod_for(anchors: torch.Tensor, block_size: int, context_len: int, window: int | None = None):
    """The same rule as `dense_mask`, as a flex_attention mask_mod (index arithmetic only)."""
    _check_window(window, block_size)

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        in_ctx = kv_idx < context_len
        anchor = anchors[b, q_block]
        ctx_ok = kv_idx < anchor
        if window is not None:
            ctx_ok = ctx_ok & (anchor + q_idx % block_size - kv_idx < window)
        block_ok = (kv_idx - context_len) // block_size == q_block
        return torch.where(in_ctx, ctx_ok, block_ok)

    return mask_mod


def flex_block_mask(anchors: torch.Tensor, block_size: int, context_len: int, window: int | None = None) -> BlockMask:
    """BlockMask for flex_attention, built on the anchors' device once per batch by tile arithmetic:
    the same tiles as `create_block_mask(mask_mod_for(...))` (tested), without evaluating the mask
    for every (query, key) pair. create_block_mask vmaps the mask_mod over the whole grid, ~19 ms of
    host time a batch even at tiny shapes (2.13, CPU): a large part of a small training step.

    A query row of block j, slot k, sees the context [lo, a_j) (lo = 0, or a_j + k - W + 1 in a
    window W) and the block keys [T + jB, T + (j+1)B). A tile (128 rows x 128 keys) is listed if any
    of its rows sees any of its keys, and as full if every row sees every key; like
    create_block_mask, tiles cut by the end of Q or KV are never full."""
    _check_window(window, block_size)
    b, n = anchors.shape
    q_len = n * block_size
    kv_len = context_len + q_len
    nq, nk = -(-q_len // TILE), -(-kv_len // TILE)
    device = anchors.device
    q = torch.arange(nq * TILE, device=device)
    real = q < q_len  # the last query tile's padding rows
    block = q // block_size
    anchor = anchors[:, block.clamp(max=n - 1)][..., None]  # [b, rows, 1]
    reach = kv_len + 1 if window is None else window  # keys this far below a row's position are masked
    row_lo = anchor + (q % block_size)[:, None] - reach + 1  # each row's lowest context key
    lo = torch.arange(nk, device=device) * TILE  # each key tile [lo, lo + TILE)
    hi = lo + TILE
    has_ctx = lo < context_len
    ctx_hi = hi.clamp(max=context_len)
    ctx_any = has_ctx & (torch.maximum(row_lo, lo) < torch.minimum(anchor, ctx_hi))
    ctx_all = ~has_ctx | ((anchor >= ctx_hi) & (row_lo <= lo))
    k_lo, k_hi = lo.clamp(min=context_len), hi.clamp(max=kv_len)  # the tile's block keys
    has_blk = k_lo < k_hi
    r_lo = (context_len + block * block_size)[:, None]  # each row's own block keys [r_lo, r_lo + B)
    r_hi = r_lo + block_size
    blk_any = has_blk & (r_lo < k_hi) & (r_hi > k_lo)
    blk_all = ~has_blk | ((r_lo <= k_lo) & (r_hi >= k_hi))
    sees_any = ((ctx_any | blk_any) & real[:, None]).view(b, nq, TILE, nk).any(dim=2)
    sees_all = (ctx_all & blk_all & real[:, None]).view(b, nq, TILE, nk).all(dim=2) & (hi <= kv_len)
    partial, full = _ordered(sees_any & ~sees_all), _ordered(sees_all)
    return BlockMask.from_kv_blocks(*partial, *full, BLOCK_SIZE=TILE,
                                    mask_mod=mask_mod_for(anchors, block_size, context_len, window),
                                    seq_lengths=(q_len, kv_len))


def decode_mask(starts: torch.Tensor, width: int, block_size: int, window: int | None) -> torch.Tensor:
    """The decoders' mask [R, 1, B, width + B] (True = attend): row r's block at positions
    starts_r .. starts_r+B-1 over context key columns that hold positions 0..width-1 (column c =
    position c), then the block's own keys. The block sees the context below its start (in a window,
    each slot only the keys less than `window` positions below it) and itself whole. Device work
    only: a captured step replays it."""
    _check_window(window, block_size)
    cols = torch.arange(width, device=starts.device)
    sees_ctx = (cols[None, :] < starts[:, None])[:, None, :]  # [R, 1, width]
    if window is None:
        sees_ctx = sees_ctx.expand(-1, block_size, -1)
    else:
        q_pos = starts[:, None] + torch.arange(block_size, device=starts.device)  # [R, B]
        sees_ctx = sees_ctx & (q_pos[:, :, None] - cols < window)
    sees_block = torch.ones(1, 1, 1, dtype=torch.bool, device=starts.device).expand(len(starts), block_size, block_size)
    return torch.cat([sees_ctx, sees_block], dim=2)[:, None]


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, nq, nk] bool -> (tiles per query row [b, 1, nq], their key-tile indices first [b, 1, nq, nk]),
    flex_attention's sparse layout (int32; a stable sort keeps the listed tiles in key order)."""
    dense = tiles[:, None].to(torch.int32)
    return dense.sum(-1, dtype=torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)


def attended_pairs(anchors: torch.Tensor, block_size: int, context_len: int, window: int | None = None) -> int:
    """(query, key) pairs the rule of `dense_mask` lets attend, over every block of `anchors` [b, N]:
    the work one head's attention does per layer (the flops of MFU), counted by arithmetic."""
    _check_window(window, block_size)
    a = anchors.to(torch.int64).clamp(max=context_len)[..., None]  # [b, N, 1]
    pos = a + torch.arange(block_size, dtype=torch.int64, device=anchors.device)  # each row's position
    lo = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp(min=0)
    context = (a - lo).clamp(min=0)
    return int(context.sum()) + anchors.numel() * block_size * block_size
