"""Anchors, labels and attention masks against brute-force loops over the rule of docs/design.md#the-objective."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from dflash_train.draft import masks


def reference_mask(anchors: torch.Tensor, block_size: int, context_len: int, window: int | None = None) -> torch.Tensor:
    """Query of block j sees context key p iff p < a_j; every key of its own block; nothing else. In a
    window W, llama.cpp's rule on top (is_masked_swa, standard): no key at a position p_k with
    p_q - p_k >= W, whatever the key."""
    b, n = anchors.shape
    q = n * block_size
    out = torch.zeros(b, 1, q, context_len + q, dtype=torch.bool)
    for bi in range(b):
        for qi in range(q):
            j = qi // block_size
            q_pos = int(anchors[bi, j]) + qi % block_size
            for kv in range(context_len + q):
                if kv < context_len:
                    seen, k_pos = kv < int(anchors[bi, j]), kv
                else:
                    seen = (kv - context_len) // block_size == j
                    k_pos = int(anchors[bi, (kv - context_len) // block_size]) + (kv - context_len) % block_size
                out[bi, 0, qi, kv] = seen and (window is None or q_pos - k_pos < window)
    return out


def random_loss_mask(b: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """Response spans at random places (some sequences with several turns, one with none)."""
    lm = torch.zeros(b, t, dtype=torch.long)
    for row in range(b - 1):
        for _ in range(2):
            start = int(torch.randint(0, t - 2, (1,), generator=gen))
            length = int(torch.randint(1, t // 2, (1,), generator=gen))
            lm[row, start : start + length] = 1
    return lm


@pytest.mark.parametrize("block_size,context_len,window", [(4, 13, None), (3, 9, None), (8, 8, None), (4, 13, 4),
                                                            (3, 40, 5), (2, 60, 7), (8, 8, 9)])
def test_dense_and_flex_masks_equal_brute_force(block_size, context_len, window):
    gen = torch.Generator().manual_seed(block_size * 100 + context_len)
    anchors = torch.randint(0, context_len, (3, 4), generator=gen)
    anchors[1, 2:] = 0  # padded / invalid anchors sit at position 0
    anchors[2, 0] = context_len - 1
    ref = reference_mask(anchors, block_size, context_len, window)
    dense = masks.dense_mask(anchors, block_size, context_len, window)
    assert dense.dtype == torch.bool
    assert torch.equal(dense, ref)
    q = anchors.shape[1] * block_size
    flex = create_mask(
        masks.mask_mod_for(anchors, block_size, context_len, window), 3, None, q, context_len + q, device="cpu"
    )
    assert torch.equal(flex.expand_as(ref), ref)


def reference_tiles(anchors: torch.Tensor, block_size: int, context_len: int,
                    window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(listed, full) [b, q tiles, key tiles] from the dense mask: a tile is listed if any pair in it
    is visible, full if all are (a tile cut by the end of Q or KV has padding, never visible)."""
    dense = masks.dense_mask(anchors, block_size, context_len, window)[:, 0]
    b, q, kv = dense.shape
    t = masks.TILE
    padded = torch.zeros(b, -(-q // t) * t, -(-kv // t) * t, dtype=torch.bool)
    padded[:, :q, :kv] = dense
    sums = padded.view(b, padded.shape[1] // t, t, padded.shape[2] // t, t).sum(dim=(2, 4))
    return sums > 0, sums == t * t


@pytest.mark.parametrize("b,n,block_size,context_len", [
    (2, 8, 16, 128), (3, 16, 16, 256), (2, 9, 16, 300), (1, 40, 16, 700), (3, 13, 10, 260), (2, 30, 4, 129),
    (2, 3, 2, 5), (2, 2, 128, 200),
])
@pytest.mark.parametrize("window", [None, 130, 40])
def test_flex_block_mask_lists_the_tiles_of_the_dense_mask(b, n, block_size, context_len, window):
    """The tile-arithmetic BlockMask against the dense mask's tiles and against create_block_mask
    over the same mask_mod (the pair-by-pair construction it replaces)."""
    gen = torch.Generator().manual_seed(b * 1000 + n * 10 + block_size)
    anchors = torch.randint(0, context_len, (b, n), generator=gen)
    anchors[0, : n // 3] = 0  # padded anchors see no context
    anchors[-1] = context_len - 1  # the whole context: full tiles where a query tile is complete
    if b > 2:  # anchors on tile edges: the context tile [0, 128) is all visible from anchor 128 on
        anchors[1] = torch.tensor([masks.TILE * (1 + j % 2) for j in range(n)]).clamp(max=context_len - 1)
    anchors = anchors.sort(dim=1).values
    if window is not None and window < block_size:
        pytest.skip("a window is at least a block")
    mask = masks.flex_block_mask(anchors, block_size, context_len, window)
    listed, full = reference_tiles(anchors, block_size, context_len, window)
    for num, idx, want in ((mask.kv_num_blocks, mask.kv_indices, listed & ~full),
                           (mask.full_kv_num_blocks, mask.full_kv_indices, full)):
        assert torch.equal(num[:, 0], want.sum(-1).int())
        for bi in range(b):
            for qi in range(want.shape[1]):
                k = int(num[bi, 0, qi])
                assert idx[bi, 0, qi, :k].tolist() == want[bi, qi].nonzero().flatten().tolist()
    assert (listed & ~full).any()
    if window is None:  # checked where they can occur
        assert full.any() == (n * block_size >= masks.TILE and context_len > masks.TILE)
    ref = create_block_mask(masks.mask_mod_for(anchors, block_size, context_len, window), b, None, n * block_size,
                            context_len + n * block_size, device="cpu")
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                  "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(mask, field), getattr(ref, field)), field
    assert mask.seq_lengths == ref.seq_lengths and mask.BLOCK_SIZE == ref.BLOCK_SIZE


def test_anchor_never_sees_its_own_position():
    """The strict `<`: the anchor token's own target features do not exist yet at inference."""
    anchors = torch.tensor([[5, 9]])
    m = masks.dense_mask(anchors, 4, 12)[0, 0]
    assert not m[0:4, 5:12].any() and m[0:4, :5].all()
    assert not m[4:8, 9:12].any() and m[4:8, :9].all()


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator):
    """Anchors as training draws them: keys on the CPU from the generator, picked on the mask's device."""
    keys = masks.upload(masks.anchor_keys(tuple(loss_mask.shape), generator), loss_mask.device)
    return masks.anchors_from_keys(loss_mask, keys, num_anchors)


def eligible_positions(loss_mask_row: torch.Tensor) -> set[int]:
    lm = loss_mask_row.tolist()
    return {i for i in range(len(lm) - 1) if lm[i] and lm[i + 1]}


@pytest.mark.parametrize("num_anchors", [1, 3, 8, 40])
def test_sample_anchors_invariants(num_anchors):
    gen = torch.Generator().manual_seed(1)
    loss_mask = random_loss_mask(4, 24, gen)
    anchors, valid = sample_anchors(loss_mask, num_anchors, torch.Generator().manual_seed(7))
    assert anchors.shape == valid.shape == (4, num_anchors)
    for row in range(4):
        eligible = eligible_positions(loss_mask[row])
        a = anchors[row][valid[row]].tolist()
        assert all(x in eligible for x in a)
        assert len(a) == len(set(a)) == min(num_anchors, len(eligible))
        assert a == sorted(a)
        k = len(a)
        assert valid[row, :k].all() and not valid[row, k:].any(), "padding must come last"
        assert (anchors[row, k:] == 0).all()
        if num_anchors >= len(eligible):
            assert set(a) == eligible
    assert not valid[3].any(), "a sequence without response has no anchor"


def test_sample_anchors_deterministic_per_seed_and_random_across_seeds():
    loss_mask = torch.ones(2, 64, dtype=torch.long)
    a1, v1 = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(3))
    a2, v2 = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(3))
    a3, _ = sample_anchors(loss_mask, 8, torch.Generator().manual_seed(4))
    assert torch.equal(a1, a2) and torch.equal(v1, v2)
    assert not torch.equal(a1, a3)
    assert not torch.equal(a1[0], a1[1]), "rows draw different anchors"


def test_sample_anchors_reach_every_eligible_position():
    loss_mask = torch.zeros(1, 30, dtype=torch.long)
    loss_mask[0, 10:20] = 1
    seen = set()
    for seed in range(60):
        a, v = sample_anchors(loss_mask, 2, torch.Generator().manual_seed(seed))
        seen |= set(a[v].tolist())
    assert seen == set(range(10, 19))


def reference_labels(input_ids, loss_mask, anchors, valid, block_size, gamma):
    b, t = input_ids.shape
    n = anchors.shape[1]
    labels = torch.full((b, n * block_size), -1, dtype=torch.long)
    weights = torch.zeros(b, n * block_size, dtype=torch.float64)
    for bi in range(b):
        for j in range(n):
            for k in range(block_size):
                pos = int(anchors[bi, j]) + k
                if pos < t:
                    labels[bi, j * block_size + k] = input_ids[bi, pos]
                if k >= 1 and bool(valid[bi, j]) and pos < t and bool(loss_mask[bi, pos]):
                    weights[bi, j * block_size + k] = math.exp(-(k - 1) / gamma)
    return labels, weights


@pytest.mark.parametrize("block_size,gamma", [(4, 7.0), (8, 4.0), (5, 1.5)])
def test_block_labels_equal_brute_force(block_size, gamma):
    gen = torch.Generator().manual_seed(block_size)
    b, t = 3, 26
    input_ids = torch.randint(0, 50, (b, t), generator=gen)
    loss_mask = random_loss_mask(b, t, gen)
    loss_mask[0, -6:] = 1  # blocks running past the sequence end
    anchors, valid = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
    labels, weights = masks.block_labels(input_ids, loss_mask, anchors, valid, block_size, gamma)
    ref_labels, ref_weights = reference_labels(input_ids, loss_mask, anchors, valid, block_size, gamma)
    assert labels.shape == weights.shape == (b, 6 * block_size)
    torch.testing.assert_close(weights.double(), ref_weights, rtol=1e-6, atol=0)
    inside = ref_labels >= 0
    assert torch.equal(labels[inside], ref_labels[inside])
    assert (weights.view(b, 6, block_size)[:, :, 0] == 0).all(), "slot 0 never has a loss"
    assert (weights.view(b, 6, block_size)[~valid] == 0).all(), "invalid blocks never have a loss"


def test_block_labels_hand_case():
    """Anchor 2 in a length-6 sequence, B=4, response at 2..4: slots predict tokens 3, 4; 5 is not response."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    lm = torch.tensor([[0, 0, 1, 1, 1, 0]])
    labels, weights = masks.block_labels(ids, lm, torch.tensor([[2]]), torch.tensor([[True]]), 4, 7.0)
    assert labels[0, 1:].tolist() == [13, 14, 15]
    torch.testing.assert_close(weights[0], torch.tensor([0.0, 1.0, math.exp(-1 / 7), 0.0]))


def test_block_inputs_and_positions():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    anchors = torch.tensor([[1, 3]])
    assert masks.block_inputs(ids, anchors, 3, 99).tolist() == [[6, 99, 99, 8, 99, 99]]
    assert masks.block_positions(anchors, 3).tolist() == [[1, 2, 3, 3, 4, 5]]


@pytest.mark.parametrize("block_size,width,window", [(4, 30, None), (4, 30, 4), (3, 50, 7), (8, 20, 64)])
def test_decode_mask_is_the_training_rule_at_each_row_start(block_size, width, window):
    """The decoders' mask (context column c = position c, then the block) is a training block's row
    of `reference_mask` with its anchor at the row's start; the columns at or past the start see nothing."""
    starts = torch.tensor([0, 1, width // 2, width])
    got = masks.decode_mask(starts, width, block_size, window)
    assert got.shape == (4, 1, block_size, width + block_size)
    for r, start in enumerate(starts.tolist()):
        ref = reference_mask(torch.tensor([[start]]), block_size, width, window)[0, 0]
        assert torch.equal(got[r, 0], ref), (start, window)


@pytest.mark.parametrize("b,n,block_size,context_len", [(2, 8, 16, 128), (3, 13, 10, 260), (2, 3, 2, 5), (1, 40, 4, 700)])
@pytest.mark.parametrize("window", [None, 130, 16])
def test_attended_pairs_count_the_dense_mask(b, n, block_size, context_len, window):
    """The attention work that MFU counts (`attended_pairs`) is the dense mask's count of True."""
    if window is not None and window < block_size:
        pytest.skip("a window is at least a block")
    gen = torch.Generator().manual_seed(b + n + context_len)
    anchors = torch.randint(0, context_len, (b, n), generator=gen).sort(dim=1).values
    anchors[0, 0] = 0  # a padded anchor: its block sees only itself
    want = int(masks.dense_mask(anchors, block_size, context_len, window).sum())
    assert masks.attended_pairs(anchors, block_size, context_len, window) == want
