"""Token-budget batching: length-grouped, deterministic from (seed, epoch), resumable by index.

Two modes. Default: greedy length-grouped batches under the budget (fewest padded tokens; CPU).
Bucket mode (`length_bucket` > 0 or a list of lengths, GPU with compile): lengths round up to a
multiple of the bucket or to the next listed length, and each bucket has ONE batch shape, rows =
budget // padded length (capped), short batches padded with empty rows, so compiled kernels see a
handful of shapes.

A batch holds at most `max_batch_size` sequences and at most `token_budget` padded tokens
(count x longest). Sequences of similar length are grouped (within shuffled windows, so batches
still vary between epochs) to waste little padding. Every sample appears exactly once per epoch.
The batch list of an epoch is a pure function of (lengths, seed, epoch): a resumed run rebuilds
it and continues at the saved (epoch, batch index), on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

WINDOW_BATCHES = 64
"""Length grouping happens inside windows of this many batches' worth of samples."""


Buckets = int | Sequence[int]
"""A multiple every padded length rounds up to, or the ascending padded lengths themselves."""


def padded_lengths(lengths: np.ndarray, buckets: Buckets) -> np.ndarray:
    """The lengths rows of `lengths` tokens are padded to: the next multiple, or the first bucket holding each."""
    lengths = np.asarray(lengths)
    if isinstance(buckets, int):
        return -(-lengths // buckets) * buckets
    index = np.searchsorted(buckets, lengths)
    if index.size and index.max() == len(buckets):
        raise ValueError(
            f"a sequence of {int(lengths.max())} tokens is longer than the longest length bucket ({buckets[-1]})")
    return np.asarray(buckets)[index]


def padded_length(length: int, buckets: Buckets) -> int:
    """padded_lengths of one row, as a Python int (bucket shapes end up in JSON and tuple comparisons)."""
    return int(padded_lengths(np.array([length]), buckets)[0])


def bucket_shape(length: int, buckets: Buckets, token_budget: int, max_batch_size: int) -> tuple[int, int]:
    """(rows, padded length) of every batch whose longest sequence is `length`, in bucket mode.

    Compiled kernels then see one shape per bucket, whatever the data: zero recompiles once each
    bucket has been compiled (dflash-train warmup).
    """
    padded = padded_length(length, buckets)
    return max(1, min(max_batch_size, token_budget // padded)), padded


def _bucketed(lengths, order, buckets: Buckets, token_budget, max_batch_size) -> list[np.ndarray]:
    padded = padded_lengths(lengths, buckets)
    batches = []
    for size in np.unique(padded):
        members = order[padded[order] == size]
        rows, _ = bucket_shape(int(size), buckets, token_budget, max_batch_size)
        batches += [members[i : i + rows] for i in range(0, len(members), rows)]
    return batches


def make_batches(
    lengths: np.ndarray, token_budget: int, max_batch_size: int, seed: int, epoch: int, length_bucket: Buckets = 0
) -> list[np.ndarray]:
    lengths = np.asarray(lengths)
    if len(lengths) and lengths.max() > token_budget:
        raise ValueError(f"a sample of {lengths.max()} tokens exceeds token_budget {token_budget}")
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    if length_bucket:
        batches = _bucketed(lengths, order, length_bucket, token_budget, max_batch_size)
        return [batches[i] for i in rng.permutation(len(batches))]
    window = max_batch_size * WINDOW_BATCHES
    batches: list[np.ndarray] = []
    for start in range(0, len(order), window):
        chunk = order[start : start + window]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        current: list[int] = []
        longest = 0
        for idx in chunk:
            longest_if_added = max(longest, int(lengths[idx]))
            if current and (
                len(current) == max_batch_size or longest_if_added * (len(current) + 1) > token_budget
            ):
                batches.append(np.array(current))
                current, longest_if_added = [], int(lengths[idx])
            current.append(int(idx))
            longest = longest_if_added
        if current:
            batches.append(np.array(current))
    return [batches[i] for i in rng.permutation(len(batches))]
