"""Micro-batches from the GLOBAL data cursor: the epoch plans, cursor arithmetic, anchor seeds, collation.

Pure functions of (config, dataset, cursor): every process and every resumed run, whatever its rank
layout, sees the same micro-batch m with the same anchors.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash_train.config import DataConfig, RunConfig
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
        make_batches(lengths, cfg.data.token_budget, cfg.data.max_batch_size, cfg.seed, e, cfg.data.length_bucket)
        for e in range(cfg.train.epochs)
    ]


def take(epoch_batches: list[list[np.ndarray]], cursor: tuple[int, int]):
    """The micro-batch the cursor points at, past finished epochs: ((epoch, batch index), its row
    indices, the cursor after it). Every rank moves the same global cursor this way."""
    epoch, index = cursor
    while index >= len(epoch_batches[epoch % len(epoch_batches)]):
        epoch, index = epoch + 1, 0
    return (epoch, index), epoch_batches[epoch % len(epoch_batches)][index], (epoch, index + 1)


def batch_shape(ds: TokenizedDataset, indices, data: DataConfig) -> tuple[int, int] | None:
    """Bucket mode: the fixed (rows, length) of this batch's bucket; otherwise None (pad to fit)."""
    if not data.length_bucket:
        return None
    longest = max(len(ds.input_ids[i]) for i in indices)
    return bucket_shape(longest, data.length_bucket, data.token_budget, data.max_batch_size)


def collate(ds: TokenizedDataset, indices, device, shape: tuple[int, int] | None = None) -> dict:
    """Padded [rows, length] tensors; `shape` fixes both (bucket mode: extra rows are empty)."""
    rows, length = shape or (len(indices), max(len(ds.input_ids[i]) for i in indices))
    ids = torch.zeros(rows, length, dtype=torch.long)
    loss_mask = torch.zeros(rows, length, dtype=torch.long)
    attn = torch.zeros(rows, length, dtype=torch.long)
    attn[len(indices):, 0] = 1  # an empty row attends to one pad token: finite features, no anchors
    for row, i in enumerate(indices):
        n = len(ds.input_ids[i])
        ids[row, :n] = torch.from_numpy(ds.input_ids[i].astype(np.int64))
        loss_mask[row, :n] = torch.from_numpy(ds.loss_mask[i].astype(np.int64))
        attn[row, :n] = 1
    return {
        "input_ids": upload(ids, device),
        "loss_mask": upload(loss_mask, device),
        "attention_mask": upload(attn, device),
        "indices": list(indices),
        "num_tokens": int(sum(len(ds.input_ids[i]) for i in indices)),
    }
