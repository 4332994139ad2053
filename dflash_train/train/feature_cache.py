"""`data.cache_features`: the target's features of every answer, kept in device memory.

Each answer's features are made once (its first batch: the target runs, or with
`data.captured_features` they are read from the capture's shards) and later epochs read them from
here. The cache stops growing before the training step would run out of memory: rows not cached by
then get their features made again every epoch (slower, never out of memory).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from dflash_train.draft.loss import DEFAULT_CHUNK_ROWS
from dflash_train.train.batches import collate

log = logging.getLogger("dflash_train")

RESERVE_GIB = 16
"""GPU memory the cache leaves free for the training step itself, at the default loss chunk
(draft/loss.py DEFAULT_CHUNK_ROWS)."""


def step_reserve(ce_chunk_size: int, vocab_size: int) -> int:
    """Bytes the cache leaves free: RESERVE_GIB, plus the logits of loss chunks larger than the
    default (fp32, ~3 chunk-sized copies alive in a chunk's forward and backward)."""
    return RESERVE_GIB * 2**30 + 3 * 4 * vocab_size * max(0, ce_chunk_size - DEFAULT_CHUNK_ROWS)


def padded(per_row: list[torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """Rows' features [T_i, K*H] -> [rows, T, K*H] of a collated batch's `shape`, zeros in its
    padding, rows included: with length_bucket a batch is padded beyond its real sequences."""
    rows, t = shape
    out = per_row[0].new_zeros(rows, t, per_row[0].shape[-1])
    for row, f in enumerate(per_row):
        out[row, : f.shape[0]] = f
    return out


class FeatureCache:
    def __init__(self, dataset, device: torch.device, reserve_bytes: int = RESERVE_GIB * 2**30):
        self.dataset, self.device, self.reserve_bytes = dataset, device, reserve_bytes
        self.rows: dict[int, torch.Tensor] = {}
        self.full = False

    def __len__(self) -> int:
        return len(self.rows)

    def features(self, batch: dict, make: Callable[[list[int]], list[torch.Tensor]]) -> torch.Tensor:
        """The batch's features [rows, T, K*H]; `make(indices)` gives the features [T_i, K*H] of the
        rows not cached, on the device (`from_target` or `from_capture`)."""
        missing = [i for i in batch["indices"] if i not in self.rows]
        fresh = self.fill(missing, make) if missing else {}
        return padded([fresh[i] if i in fresh else self.rows[i] for i in batch["indices"]], batch["input_ids"].shape)

    def fill(self, indices: list[int], make: Callable[[list[int]], list[torch.Tensor]]) -> dict[int, torch.Tensor]:
        """Makes the rows' features and keeps them if the memory allows; returns them either way."""
        fresh = dict(zip(indices, make(indices)))
        if self.has_room(sum(f.nbytes for f in fresh.values())):
            # A view (the target's rows) would keep the whole padded batch alive: copied. Rows that
            # own their memory (read from a capture) are kept as they are.
            self.rows.update({i: f.clone() if f._base is not None else f for i, f in fresh.items()})
        return fresh

    def has_room(self, nbytes: int) -> bool:
        """Whether the cache may grow by `nbytes` and leave `reserve_bytes` free."""
        if self.device.type != "cuda":
            return True
        free, _ = torch.cuda.mem_get_info(self.device)
        room = free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if room - nbytes > self.reserve_bytes:
            return True
        if not self.full:
            self.full = True
            log.warning("feature cache full at %d rows (%.1f GiB free): the other rows' features are recomputed",
                        len(self.rows), room / 2**30)
        return False


def from_target(dataset, device: torch.device, compute: Callable[[torch.Tensor], torch.Tensor]):
    """`make` for the cache: the target (`compute(input_ids)`) runs over the rows, batched."""

    def make(indices: list[int]) -> list[torch.Tensor]:
        feats = compute(collate(dataset, indices, device)["input_ids"])
        return [feats[row, : len(dataset.input_ids[i])] for row, i in enumerate(indices)]

    return make


def from_capture(captured, device: torch.device):
    """`make` for the cache: the rows read from a `dflash-train capture` directory."""
    return lambda indices: [captured.row(i).to(device, non_blocking=True) for i in indices]
