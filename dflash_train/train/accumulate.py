"""One optimizer step's micro-batches, and the one loop that runs them.

Where a step's micro-batches come from and how their sums are combined differ between the
single-process run and a drafter rank of distributed training; what is done with them does
not. So the step (train/step.py) is composed of a source (`LocalSource` here,
`distributed/roles.py LinkSource`) and a reduction (`NoReduction` here, `distributed/roles.py
GroupReduction`), and `accumulate` is the only forward/backward loop, also used by the held-out
scoring (without backward). A `Replica` carries the distributed pair and what else makes a run one
rank of several.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch

from dflash_train.config import RunConfig
from dflash_train.draft.acceptance import BlockLoss, LossTally
from dflash_train.draft.objective import BlockTask, make_task
from dflash_train.train.batches import anchor_seed, collate_as_trained, take
from dflash_train.train.build import RunParts
from dflash_train.train.progress import Progress


@dataclass
class MicroBatch:
    task: BlockTask
    features: Callable[[], torch.Tensor]
    """Called once, in order: the features [rows, T, K*H] (a distributed source receives them then)."""
    tokens: int


def accumulate(forward: Callable[[BlockTask, torch.Tensor], BlockLoss], micro: Iterable[MicroBatch],
               tally: LossTally, denominator: torch.Tensor | None = None) -> LossTally:
    """Runs every micro-batch through `forward`, adds its sums to `tally` and, with a
    `denominator`, backpropagates its share of the step's normalised loss (gradients accumulate)."""
    for mb in micro:
        out = forward(mb.task, mb.features())
        if denominator is not None:
            (out.weighted_ce_sum / denominator).backward()
        tally.add(out)
        del out  # without a backward (held-out scoring) it holds the graph while the next one forms
    return tally


class Source(Protocol):
    def micro_batches(self, progress: Progress) -> list[MicroBatch]:
        """The step's micro-batches; `progress.cursor` moves past every micro-batch of the step."""


class Reduction(Protocol):
    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the replicas of this drafter (in place)."""

    def finish(self, params: Iterable[torch.Tensor], stats: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int]:
        """Sums the gradients of `params`, the flat `stats` and the `tokens` over the replicas."""

    def any_of(self, flags: list[bool], device: torch.device) -> list[bool]:
        """Each flag true on any replica: what every replica then acts on alike (a stop signal)."""


class LocalSource:
    """The single process's own cursor, data and target (or its feature cache)."""

    def __init__(self, cfg: RunConfig, parts: RunParts):
        self.cfg, self.parts = cfg, parts

    def next_micro_batch(self, progress: Progress) -> tuple[dict, int]:
        """The batch at the cursor, collated as trained, and its anchor seed; the cursor moves on."""
        (epoch, index), indices, progress.cursor = take(self.parts.epoch_batches, progress.cursor)
        return (collate_as_trained(self.parts.dataset, indices, self.parts.device, self.cfg.data),
                anchor_seed(self.cfg.seed, epoch, index))

    def micro_batches(self, progress: Progress) -> list[MicroBatch]:
        micro = []
        for _ in range(self.cfg.train.grad_accum):
            batch, seed = self.next_micro_batch(progress)
            task = make_task(batch["input_ids"], batch["loss_mask"], self.cfg.objective, seed)
            micro.append(MicroBatch(task, lambda b=batch: self.parts.features(b), batch["num_tokens"]))
        return micro


class NoReduction:
    """One replica: sums are already global."""

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def finish(self, params, stats: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int]:
        return stats, tokens

    def any_of(self, flags: list[bool], device: torch.device) -> list[bool]:
        return flags


@dataclass
class Replica:
    """What makes a run one drafter replica of distributed training (built by distributed/roles.py)."""
    source: Source
    reduction: Reduction
    devices: int
    """Devices the whole job holds: the held-out probe's device-seconds count them all."""
    leader: bool
    """The group's first rank: the only one that evaluates, logs and saves."""
    start: Callable[[Progress], None]
    """Called once the run is resumed, before its first step: every rank agrees where the stream starts."""
