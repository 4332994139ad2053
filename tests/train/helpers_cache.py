"""Rows for the feature cache's tests (CPU and CUDA): ragged random rows, a counting `make`, and
the batch a brute-force padding of them gives."""

from __future__ import annotations

import torch


class Rows:
    """`make` over fixed random rows of ragged lengths, counting what it is asked for."""

    def __init__(self, lengths: list[int], width: int, dtype: torch.dtype, device: str = "cpu"):
        g = torch.Generator().manual_seed(0)
        self.rows = [torch.randn(n, width, generator=g).to(dtype) for n in lengths]
        self.on_device = [r.to(device) for r in self.rows]
        self.asked: list[int] = []

    def __call__(self, indices: list[int]) -> list[torch.Tensor]:
        self.asked += indices
        return [self.on_device[i] * 1 for i in indices]  # fresh tensors, as the target's rows are


def reference(rows: list[torch.Tensor], indices: list[int], length: int) -> torch.Tensor:
    """The batch's features padded by hand: one more row than `indices` (bucket padding), zeros
    past each row's length."""
    out = torch.zeros(len(indices) + 1, length, rows[0].shape[1], dtype=rows[0].dtype)
    for r, i in enumerate(indices):
        out[r, : rows[i].shape[0]] = rows[i]
    return out


def epoch_batches(n: int, size: int, length: int) -> list[dict]:
    """One epoch's collated batches (indices and an input_ids of the padded shape)."""
    return [{"indices": list(range(s, min(s + size, n))),
             "input_ids": torch.zeros(min(size, n - s) + 1, length, dtype=torch.long)} for s in range(0, n, size)]
