"""The two roles of disaggregated training and the messages between them.

A target rank takes its share of every step's micro-batches from the GLOBAL cursor (micro-batch m
of a step belongs to target m % T), runs the frozen target and sends, per micro-batch, a header
(shape, tokens, masks, anchor seed) and then the features to the rank of each drafter group that
consumes m (group rank m % D). A drafter rank receives the headers of its micro-batches first:
loss weights depend only on tokens and anchor seeds, so the step's global weight sum is
all-reduced among the group before any backward, and per-step losses equal the single-process
run's. Messages between a pair of ranks are sent and received in the same order
(step, headers before features, m), so matching needs no tags and no cycle can deadlock.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from dflash_train.config import RunConfig
from dflash_train.data.dataset import TokenizedDataset
from dflash_train.draft.objective import make_task
from dflash_train.eval.report import check_periodic_eval, periodic_eval_for
from dflash_train.targets.model import Target
from dflash_train.distributed.layout import Layout
from dflash_train.train.batches import anchor_seed, collate_as_trained, epoch_plan, take
from dflash_train.train.accumulate import MicroBatch, Replica
from dflash_train.train.build import RunParts, build
from dflash_train.train.loop import train_replica
from dflash_train.train.progress import Progress

log = logging.getLogger("dflash_train")


@dataclass
class Header:
    input_ids: torch.Tensor  # [b, T]
    loss_mask: torch.Tensor  # [b, T]
    seed: int
    num_tokens: int  # real tokens, as collated (a bucket's empty rows hold none)


class Link:
    """Point-to-point micro-batch messages of one rank, with at most `max_in_flight` unfinished
    sends: a target that runs ahead of slow drafters blocks instead of piling up features.
    A message to this same rank (colocated) is queued, and its features are computed only when
    the drafter consumes them, so colocated memory is that of single-process training."""

    def __init__(self, rank: int, device: torch.device, max_in_flight: int):
        self.rank = rank
        self.device = device
        self.max_in_flight = max_in_flight
        self.local: deque = deque()
        self.in_flight: deque = deque()

    def send_header(self, dst: int, batch: dict, seed: int) -> None:
        if dst == self.rank:
            self.local.append(Header(batch["input_ids"], batch["loss_mask"], seed, batch["num_tokens"]))
            return
        b, t = batch["input_ids"].shape
        meta = torch.tensor([b, t, seed, batch["num_tokens"]], dtype=torch.int64, device=self.device)
        packed = torch.stack([batch["input_ids"], batch["loss_mask"]])
        self._isend(dst, meta, packed)

    def send_features(self, dst: int, make: Callable[[], torch.Tensor]) -> None:
        if dst == self.rank:
            self.local.append(make)
        else:
            self._isend(dst, make().contiguous())

    def recv_header(self, src: int) -> Header:
        if src == self.rank:
            return self.local.popleft()
        meta = torch.empty(4, dtype=torch.int64, device=self.device)
        dist.recv(meta, src)
        b, t, seed, num_tokens = meta.tolist()
        packed = torch.empty(2, b, t, dtype=torch.int64, device=self.device)
        dist.recv(packed, src)
        return Header(packed[0], packed[1], seed, num_tokens)

    def recv_features(self, src: int, shape: tuple, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
        """Posts the receive now and returns the wait: the next micro-batch's features arrive
        while the current one trains."""
        if src == self.rank:
            return self.local.popleft()
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        work = dist.irecv(buf, src)

        def wait() -> torch.Tensor:
            work.wait()
            return buf

        return wait

    def _isend(self, dst: int, *tensors: torch.Tensor) -> None:
        # The tensors stay referenced until their send completed.
        self.in_flight.append(([dist.isend(t, dst) for t in tensors], tensors))
        while len(self.in_flight) > self.max_in_flight:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        works, _ = self.in_flight.popleft()
        for w in works:
            w.wait()

    def drain(self) -> None:
        while self.in_flight:
            self._wait_oldest()


class TargetFeeder:
    """One target rank: global cursor -> its group's micro-batches -> features -> every drafter
    group. In a tensor-parallel group every rank runs the same forwards (each holds a shard) and only
    the lead sends."""

    def __init__(self, cfg: RunConfig, target: Target, dataset: TokenizedDataset, layout: Layout,
                 link: Link, rank: int, group_layer_ids: list[list[int]]):
        self.cfg, self.target, self.dataset, self.layout, self.link, self.rank = cfg, target, dataset, layout, link, rank
        self.epoch_batches = epoch_plan(cfg, dataset.lengths)
        self.cursor = (0, 0)
        # Groups may capture different layers: run the target once over their union, then slice.
        self.layer_ids = list(dict.fromkeys(i for ids in group_layer_ids for i in ids))
        self.group_layer_ids = group_layer_ids

    def _select(self, feats: torch.Tensor, group: int) -> torch.Tensor:
        ids = self.group_layer_ids[group]
        if ids == self.layer_ids:
            return feats
        h = self.target.hidden_size
        return torch.cat([feats[..., self.layer_ids.index(i) * h:(self.layer_ids.index(i) + 1) * h] for i in ids], -1)

    def feed_step(self) -> None:
        batches = []
        for m in range(self.cfg.train.grad_accum):
            (epoch, index), indices, self.cursor = take(self.epoch_batches, self.cursor)
            if self.layout.target_of(m) == self.layout.target_lead(self.rank):
                batches.append((m, collate_as_trained(self.dataset, indices, self.target.device, self.cfg.data),
                                anchor_seed(self.cfg.seed, epoch, index)))
        lead = self.layout.target_lead(self.rank) == self.rank
        for m, batch, seed in batches:
            for dst in self.layout.consumers(m) if lead else ():
                self.link.send_header(dst, batch, seed)
        for m, batch, _ in batches:
            feats = functools.cache(
                lambda b=batch: self.target.features(b["input_ids"], self.layer_ids)
            )
            if not lead:
                feats()  # this rank's shard of the group's forward
            for group, dst in enumerate(self.layout.consumers(m)) if lead else ():
                self.link.send_features(dst, lambda g=group, f=feats: self._select(f(), g))


def check_single_process_keys(cfg: RunConfig) -> None:
    """Keys `dflash-train train` honours that a launch cannot: refused by name, never ignored."""
    if cfg.data.cache_features:
        raise ValueError("data.cache_features keeps the features in the memory of the one process that trains "
                         "(`dflash-train train`); under launch the target ranks stream them every epoch: remove it")
    if cfg.data.captured_features:
        raise ValueError("data.captured_features is read by `dflash-train train` (one process); under launch "
                         "the target ranks compute the features: remove it, or train with `dflash-train train`")
    if cfg.train.cuda_graphs:
        raise ValueError("train.cuda_graphs captures the whole step of `dflash-train train` (one process); a "
                         "drafter rank of launch exchanges its sums between micro-batches: remove it")


def check_lead_rank_evals(cfg: RunConfig, layout: Layout) -> None:
    """`eval.every` (real speculative decoding) and `eval.heldout_files` (teacher-forced scoring) run
    on a drafter group's lead rank and need the whole target there: colocated only, since in a split
    layout drafter ranks hold only the target's embedding and LM head."""
    check_periodic_eval(cfg.eval)
    if layout.colocated:
        return
    for key, on in (("eval.every", cfg.eval.every), ("eval.heldout_files", cfg.eval.heldout_files)):
        if on:
            raise ValueError(f"{key} needs the whole target on the drafter's lead rank: use --colocated, or evaluate "
                             "checkpoints with `dflash-train eval` (in a split layout drafter ranks hold only the "
                             "target's embedding and LM head)")


class LinkSource:
    """A drafter rank's micro-batches: its share of the global cursor, headers then features received
    from the target ranks (the next micro-batch's features arrive while this one trains). Colocated,
    this process first runs its own target share (`feeder`)."""

    def __init__(self, cfg: RunConfig, parts: RunParts, layout: Layout, link: Link, rank: int, group_index: int,
                 feeder: TargetFeeder | None):
        self.layout, self.link, self.feeder = layout, link, feeder
        self.objective, self.grad_accum, self.epoch_batches = cfg.objective, cfg.train.grad_accum, parts.epoch_batches
        self.mine = layout.consumed_by(rank, group_index, cfg.train.grad_accum)
        self.width = len(parts.stream_layers) * parts.target.hidden_size
        self.dtype = parts.target.embed_weight.dtype

    def micro_batches(self, progress: Progress) -> list[MicroBatch]:
        if self.feeder is not None:
            self.feeder.feed_step()
        for _ in range(self.grad_accum):  # the global cursor moves past every micro-batch
            progress.cursor = take(self.epoch_batches, progress.cursor)[2]
        sources = [self.layout.target_of(m) for m in self.mine]
        headers = [self.link.recv_header(src) for src in sources]
        pending: list = []

        def receive(k: int):
            shape = (*headers[k].input_ids.shape, self.width)
            pending.append(self.link.recv_features(sources[k], shape, self.dtype))

        def features(k: int) -> torch.Tensor:
            if k == 0:
                receive(0)
            if k + 1 < len(headers):
                receive(k + 1)  # posted before this micro-batch trains
            return pending[k]()

        return [MicroBatch(make_task(h.input_ids, h.loss_mask, self.objective, h.seed),
                           functools.partial(features, k), h.num_tokens)
                for k, h in enumerate(headers)]


class GroupReduction:
    """Sums over the ranks of one drafter group: a plain SUM all-reduce, not DDP (see train/step.py)."""

    def __init__(self, group):
        self.group = group

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(value, group=self.group)
        return value

    def any_of(self, flags: list[bool], device: torch.device) -> list[bool]:
        if dist.get_world_size(self.group) == 1:
            return flags
        return [bool(f) for f in self.sum(torch.tensor(flags, dtype=torch.float32, device=device)).tolist()]

    def finish(self, params, stats: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int]:
        works = [dist.all_reduce(p.grad, group=self.group, async_op=True) for p in params]
        stats = torch.cat([stats, torch.tensor([float(tokens)], device=stats.device)])
        works.append(dist.all_reduce(stats, group=self.group, async_op=True))
        for w in works:
            w.wait()
        return stats[:-1], int(stats[-1])


def agree_on_start(layout: Layout, rank: int, feeder: TargetFeeder | None, progress: Progress | None
                   ) -> tuple[int, int]:
    """Every rank learns where the stream starts (a drafter rank from its `progress`, after resuming;
    all drafter groups must agree) and its target share starts there. Returns (step, total_steps)."""
    start = (progress.step, tuple(progress.cursor), progress.total_steps) if progress else None
    states: list = [None] * layout.world_size
    dist.all_gather_object(states, start)
    found = {s for s in states if s is not None}
    if len(found) != 1:
        raise ValueError(f"drafter groups disagree on (step, cursor, total_steps): {sorted(found)}")
    step, cursor, total_steps = found.pop()
    log.info("rank %d = %s; starting at step %d of %d, cursor %s", rank, layout.describe(rank), step,
             total_steps, cursor)
    if feeder is not None:
        feeder.cursor = cursor
    return step, total_steps


def run_drafter(cfg: RunConfig, target: Target, dataset: TokenizedDataset | None, *, layout: Layout, link: Link,
                rank: int, group_index: int, group, feeder: TargetFeeder | None, resume: str | Path | None
                ) -> str | None:
    """One data-parallel replica of a drafter group: its features come from the target ranks and its
    sums run over the group. Only the group's first rank evaluates, logs and saves. Returns the stop
    signal that ended it early, else None."""
    check_lead_rank_evals(cfg, layout)
    leader = rank == layout.group_ranks(group_index)[0]
    periodic_eval = periodic_eval_for(cfg) if leader else None
    parts = build(cfg, target, dataset)
    replica = Replica(LinkSource(cfg, parts, layout, link, rank, group_index, feeder), GroupReduction(group),
                      devices=layout.world_size, leader=leader,
                      start=functools.partial(agree_on_start, layout, rank, feeder))
    return train_replica(cfg, parts, replica, resume=resume, periodic_eval=periodic_eval)
