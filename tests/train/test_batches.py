"""Collation against a row-by-row reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_train.data.dataset import TokenizedDataset
from dflash_train.train.batches import collate


def reference(ds: TokenizedDataset, indices, rows: int, length: int) -> dict:
    ids, mask, attn = (torch.zeros(rows, length, dtype=torch.long) for _ in range(3))
    for r, i in enumerate(indices):
        for c, (tok, m) in enumerate(zip(ds.input_ids[i], ds.loss_mask[i])):
            ids[r, c], mask[r, c], attn[r, c] = int(tok), int(m), 1
    for r in range(len(indices), rows):
        attn[r, 0] = 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


@pytest.mark.parametrize("shape", [None, (7, 40)])
def test_collate_pads_every_row_as_the_row_by_row_copy(shape):
    rng = np.random.default_rng(3)
    ds = TokenizedDataset()
    for _ in range(12):
        n = int(rng.integers(1, 33))
        ds.append(rng.integers(0, 50_000, n), rng.integers(0, 2, n))
    indices = [9, 2, 11, 0, 5]  # any order; the longest row is not first
    batch = collate(ds, indices, "cpu", shape)
    rows, length = shape or (5, max(len(ds.input_ids[i]) for i in indices))
    want = reference(ds, indices, rows, length)
    for key, value in want.items():
        assert batch[key].dtype == torch.long and torch.equal(batch[key], value), key
    assert batch["indices"] == indices
    assert batch["num_tokens"] == sum(len(ds.input_ids[i]) for i in indices)
