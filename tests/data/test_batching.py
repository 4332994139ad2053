"""Token-budget batching invariants."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_train.data.batching import make_batches


def lengths(n=700, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(5, 300, size=n)


@pytest.mark.parametrize("token_budget,max_batch_size", [(300, 4), (1024, 8), (5000, 16), (300, 1)])
def test_budget_size_and_exactly_once(token_budget, max_batch_size):
    lens = lengths()
    for epoch in range(2):
        batches = make_batches(lens, token_budget, max_batch_size, seed=1, epoch=epoch)
        for b in batches:
            assert 1 <= len(b) <= max_batch_size
            assert len(b) * lens[b].max() <= token_budget
        flat = np.concatenate(batches)
        assert sorted(flat.tolist()) == list(range(len(lens)))


def test_deterministic_for_seed_and_epoch_and_different_across_epochs():
    lens = lengths()
    a = make_batches(lens, 1024, 8, seed=3, epoch=0)
    b = make_batches(lens, 1024, 8, seed=3, epoch=0)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    c = make_batches(lens, 1024, 8, seed=3, epoch=1)
    d = make_batches(lens, 1024, 8, seed=4, epoch=0)
    assert np.concatenate(a).tolist() != np.concatenate(c).tolist()
    assert np.concatenate(a).tolist() != np.concatenate(d).tolist()
    assert {tuple(sorted(x.tolist())) for x in a} != {tuple(sorted(x.tolist())) for x in c}, (
        "batch composition should change between epochs"
    )


def test_batches_are_reasonably_full():
    """Length grouping: padding waste stays small (an ungrouped packer wastes far more)."""
    lens = lengths(2000)
    batches = make_batches(lens, 2048, 64, seed=0, epoch=0)
    padded = sum(len(b) * lens[b].max() for b in batches)
    assert lens.sum() / padded > 0.85


def test_sample_longer_than_budget_is_refused():
    with pytest.raises(ValueError, match="token_budget"):
        make_batches(np.array([10, 400]), 300, 4, seed=0, epoch=0)


def test_bucket_mode_has_one_shape_per_bucket_and_keeps_every_sample():
    from dflash_train.data.batching import bucket_shape

    lengths = np.random.default_rng(0).integers(10, 500, 300)
    batches = make_batches(lengths, 2048, 8, seed=0, epoch=0, length_bucket=128)
    assert sorted(np.concatenate(batches).tolist()) == list(range(300))
    shapes = set()
    for batch in batches:
        rows, padded = bucket_shape(int(lengths[batch].max()), 128, 2048, 8)
        assert len(batch) <= rows and rows * padded <= 2048 and padded % 128 == 0
        assert lengths[batch].max() <= padded
        shapes.add((rows, padded))
    assert len(shapes) == 4  # buckets 128, 256, 384, 512: one compiled shape each


def test_listed_buckets_pad_each_batch_to_the_next_listed_length():
    """data.length_buckets: a batch is padded to the first listed length holding its longest row, so a
    short row of a long dataset is not padded to a long multiple; every sample kept, one shape a length."""
    from dflash_train.data.batching import bucket_shape, padded_length

    buckets = (64, 128, 256, 512, 1024)
    lengths = np.random.default_rng(1).integers(5, 1025, 400)
    batches = make_batches(lengths, 2048, 16, seed=0, epoch=0, length_bucket=buckets)
    assert sorted(np.concatenate(batches).tolist()) == list(range(400))
    shapes = set()
    for batch in batches:
        longest = int(lengths[batch].max())
        rows, padded = bucket_shape(longest, buckets, 2048, 16)
        assert padded == min(b for b in buckets if b >= longest)  # the next listed length, brute force
        assert len(batch) <= rows == min(16, 2048 // padded)
        assert all(padded_length(int(n), buckets) == padded for n in lengths[batch])  # rows share one bucket
        shapes.add((rows, padded))
    assert shapes == {bucket_shape(b, buckets, 2048, 16) for b in buckets}
    with pytest.raises(ValueError, match="longer than the longest length bucket"):
        make_batches(np.array([10, 1100]), 2048, 4, seed=0, epoch=0, length_bucket=buckets)
