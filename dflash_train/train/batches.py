"""Micro-batches from the GLOBAL data cursor: the epoch plans, cursor arithmetic, anchor seeds, collation.

Pure functions of (config, dataset, cursor): every process and every resumed run, whatever its rank
layout, sees the same micro-batch m with the same anchors.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash_train.config import RunConfig
from dflash_train.config_training import DataConfig
from dflash_train.data.batching import bucket_shape, make_batches
from dflash_train.data.dataset import TokenizedDataset
from dflash_train.draft.masks import upload

HELDOUT_SALT = 2**31 - 1
"""Anchor seeds of held-out evaluation never coincide with those of a training epoch."""


def anchor_seed(seed: int, epoch: int, batch_index: int) -> int:
    return int(np.random.SeedSequence([seed, epoch, batch_index]).generate_state(1)[0])


def epoch_plan(cfg: RunConfig, lengths: np.ndarray) -> list[list[np.ndarray]]:
    """Batches of every epoch: a pure function of (lengths, config), so every rank builds the same."""
    return [
        make_batches(lengths, cfg.data.token_budget, cfg.data.max_batch_size, cfg.seed, e, cfg.data.buckets)
        for e in range(cfg.train.epochs)
    ]


def take(epoch_batches: list[list[np.ndarray]], cursor: tuple[int, int]):
    """The micro-batch the cursor points at, past finished epochs: ((epoch, batch index), its row
    indices, the cursor after it). Every rank moves the same global cursor this way."""
    epoch, index = cursor
    while index >= len(epoch_batches[epoch % len(epoch_batches)]):
        epoch, index = epoch + 1, 0
    return (epoch, index), epoch_batches[epoch % len(epoch_batches)][index], (epoch, index + 1)


def _bucket_of(ds: TokenizedDataset, indices, data: DataConfig) -> tuple[int, int] | None:
    """Bucket mode: the fixed (rows, length) of this batch's bucket; otherwise None (pad to fit)."""
    if not data.buckets:
        return None
    longest = max(len(ds.input_ids[i]) for i in indices)
    return bucket_shape(longest, data.buckets, data.token_budget, data.max_batch_size)


def collate_as_trained(ds: TokenizedDataset, indices, device, data: DataConfig) -> dict:
    """`collate` in the shape training gives these rows (their length bucket's, with `data.length_bucket`):
    every batch a compiled drafter sees, held-out scoring's too, must have one of the warmed-up shapes."""
    return collate(ds, indices, device, _bucket_of(ds, indices, data))


def collate(ds: TokenizedDataset, indices, device, shape: tuple[int, int] | None = None) -> dict:
    """Padded [rows, length] tensors; `shape` fixes both (bucket mode: extra rows are empty). One
    scatter of all rows' tokens, not a copy per row: at 64 rows a step the per-row copies cost ~5 ms
    of host time, which a small training step waits for."""
    rows_ids = [ds.input_ids[i] for i in indices]
    lengths = np.array([len(r) for r in rows_ids], dtype=np.int64)
    rows, length = shape or (len(indices), int(lengths.max()))
    row = np.repeat(np.arange(len(indices)), lengths)
    col = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    ids = np.zeros((rows, length), dtype=np.int64)
    loss_mask = np.zeros((rows, length), dtype=np.int64)
    attn = np.zeros((rows, length), dtype=np.int64)
    ids[row, col] = np.concatenate(rows_ids)
    loss_mask[row, col] = np.concatenate([ds.loss_mask[i] for i in indices])
    attn[row, col] = 1
    attn[len(indices):, 0] = 1  # an empty row attends to one pad token: finite features, no anchors
    return {
        "input_ids": upload(torch.from_numpy(ids), device),
        "loss_mask": upload(torch.from_numpy(loss_mask), device),
        "attention_mask": upload(torch.from_numpy(attn), device),
        "indices": list(indices),
        "num_tokens": int(lengths.sum()),
    }
