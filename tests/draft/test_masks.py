"""Anchors, labels and attention masks against brute-force loops over the rule of docs/design.md#the-objective."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from dflash_train.draft import masks


def reference_mask(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """Query of block j sees context key p iff p < a_j; every key of its own block; nothing else."""
    b, n = anchors.shape
    q = n * block_size
    out = torch.zeros(b, 1, q, context_len + q, dtype=torch.bool)
    for bi in range(b):
        for qi in range(q):
            j = qi // block_size
            for kv in range(context_len + q):
                if kv < context_len:
                    out[bi, 0, qi, kv] = kv < int(anchors[bi, j])
                else:
                    out[bi, 0, qi, kv] = (kv - context_len) // block_size == j
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


@pytest.mark.parametrize("block_size,context_len", [(4, 13), (3, 9), (8, 8)])
def test_dense_and_flex_masks_equal_brute_force(block_size, context_len):
    gen = torch.Generator().manual_seed(block_size * 100 + context_len)
    anchors = torch.randint(0, context_len, (3, 4), generator=gen)
    anchors[1, 2:] = 0  # padded / invalid anchors sit at position 0
    anchors[2, 0] = context_len - 1
    ref = reference_mask(anchors, block_size, context_len)
    dense = masks.dense_mask(anchors, block_size, context_len)
    assert dense.dtype == torch.bool
    assert torch.equal(dense, ref)
    q = anchors.shape[1] * block_size
    flex = create_mask(
        masks.mask_mod_for(anchors, block_size, context_len), 3, None, q, context_len + q, device="cpu"
    )
    assert torch.equal(flex.expand_as(ref), ref)


def test_anchor_never_sees_its_own_position():
    """The strict `<`: the anchor token's own target features do not exist yet at inference."""
    anchors = torch.tensor([[5, 9]])
    m = masks.dense_mask(anchors, 4, 12)[0, 0]
    assert not m[0:4, 5:12].any() and m[0:4, :5].all()
    assert not m[4:8, 9:12].any() and m[4:8, :9].all()


def eligible_positions(loss_mask_row: torch.Tensor) -> set[int]:
    lm = loss_mask_row.tolist()
    return {i for i in range(len(lm) - 1) if lm[i] and lm[i + 1]}


@pytest.mark.parametrize("num_anchors", [1, 3, 8, 40])
def test_sample_anchors_invariants(num_anchors):
    gen = torch.Generator().manual_seed(1)
    loss_mask = random_loss_mask(4, 24, gen)
    anchors, valid = masks.sample_anchors(loss_mask, num_anchors, torch.Generator().manual_seed(7))
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
    a1, v1 = masks.sample_anchors(loss_mask, 8, torch.Generator().manual_seed(3))
    a2, v2 = masks.sample_anchors(loss_mask, 8, torch.Generator().manual_seed(3))
    a3, _ = masks.sample_anchors(loss_mask, 8, torch.Generator().manual_seed(4))
    assert torch.equal(a1, a2) and torch.equal(v1, v2)
    assert not torch.equal(a1, a3)
    assert not torch.equal(a1[0], a1[1]), "rows draw different anchors"


def test_sample_anchors_reach_every_eligible_position():
    loss_mask = torch.zeros(1, 30, dtype=torch.long)
    loss_mask[0, 10:20] = 1
    seen = set()
    for seed in range(60):
        a, v = masks.sample_anchors(loss_mask, 2, torch.Generator().manual_seed(seed))
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
    anchors, valid = masks.sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
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
