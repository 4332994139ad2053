"""The one shape every decoder here has: prefill the rows, step a round, hand on the rows that finished.

A decoder (speculative or the target alone, eager, batched or static) keeps its own caches and
decisions; `decode_rows` is the loop around it, the same for all: one prefill, then rounds while
any row decodes, each finished row handed to `release` the round it ends (a slow row does not hold
the others' answers back), and the decode time taken after the prefill (the first token comes
from the prefill in every decoder and is not timed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from dflash_train.targets.model import synced_time


class RoundDecoder(Protocol):
    """Rows decoded round by round; `results[row]` grows as the row's tokens are emitted."""

    device: torch.device
    results: list
    """Per row: a DecodeResult (the target alone) or a SpecResult (speculative), set by `prefill`."""

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        """Runs the prompts (token ids); the rows whose answer already ended (its first token)."""

    def step(self) -> list[int]:
        """One round over the rows still decoding; the rows it finished."""

    def decoding(self) -> bool:
        """Whether any row still decodes."""


def decode_rows(decoder: RoundDecoder, prompts: list[list[int]],
                release: Callable[[int, object], None] | None = None) -> tuple[list, float]:
    """Every row of `prompts` decoded to its end: (results, seconds after the prefill; 0.0 when the
    prefill ended every row). `release(row, result)` as each row finishes."""
    finished, rounds = decoder.prefill(prompts), 0
    t0 = synced_time(decoder.device)
    while True:
        if release is not None:
            for row in finished:
                release(row, decoder.results[row])
        if not decoder.decoding():
            break
        finished, rounds = decoder.step(), rounds + 1
    return decoder.results, synced_time(decoder.device) - t0 if rounds else 0.0
