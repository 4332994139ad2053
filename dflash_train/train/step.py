"""One optimizer step: `grad_accum` micro-batches, then clip, update and advance the schedule.

Loss weights are known before the drafter runs, so the step's GLOBAL weight sum is computed first
and every micro-batch's weighted CE sum is divided by it: the loss is exactly sum(w * CE) / sum(w)
over the whole step, however it is split. Gradients and statistics are summed over the replicas (a
plain sum, not DDP's mean: replicas may hold different numbers of micro-batches). The hot path has
no host sync. With `train.cuda_graphs` the step runs as one captured CUDA graph per bucket shape
(train/step_graph.py).
"""

from __future__ import annotations

import logging
import time

import torch

from dflash_train.config import RunConfig
from dflash_train.draft.acceptance import LossTally
from dflash_train.draft.objective import make_task
from dflash_train.errors import UserError
from dflash_train.targets.model import warm_up_compiled
from dflash_train.train.accumulate import LocalSource, NoReduction, Replica, accumulate
from dflash_train.train.build import RunParts
from dflash_train.train.progress import Progress
from dflash_train.train.shapes import bucket_shapes, synthetic_batch
from dflash_train.train.step_graph import StepGraphs

log = logging.getLogger("dflash_train")


def _too_large(cfg: RunConfig, rows: int, length: int, device: torch.device) -> str:
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    return (f"the drafter's step of {rows} rows x {length} tokens does not fit in the {total:.0f} GiB of "
            f"{torch.cuda.get_device_name(device)} (draft.family={cfg.draft.family}, data.token_budget="
            f"{cfg.data.token_budget}, objective.ce_chunk_size={cfg.objective.ce_chunk_size}, "
            f"{cfg.objective.anchors_per_row(length)} anchors a row from objective.num_anchors="
            f"{cfg.objective.num_anchors} and num_anchors_length={cfg.objective.num_anchors_length}): lower one of them")


class TrainStep:
    """`step(progress)`: one optimizer step of the run's parts, from its source over its reduction."""

    def __init__(self, cfg: RunConfig, parts: RunParts, replica: Replica | None = None):
        self.cfg, self.parts = cfg, parts
        self.local = LocalSource(cfg, parts)
        self.source = replica.source if replica else self.local
        self.reduction = replica.reduction if replica else NoReduction()
        self.graphs = (StepGraphs.for_run(parts, cfg.objective, single_process=replica is None)
                       if cfg.train.cuda_graphs else None)

    def __call__(self, progress: Progress) -> dict:
        if self.graphs is not None:
            return self._graphed(progress)
        p = self.parts
        micro = self.source.micro_batches(progress)
        weights = sum((mb.task.weights.sum() for mb in micro), torch.zeros((), device=p.device))
        denominator = self.reduction.sum(weights).clamp(min=1e-12)
        tally = accumulate(p.forward, micro, LossTally(p.drafter.config.block_size, p.device), denominator)
        stats = torch.cat([tally.loss_sum.view(1), tally.correct, tally.counted, tally.accepted])
        stats, tokens = self.reduction.finish(p.drafter.parameters(), stats, sum(mb.tokens for mb in micro))
        correct, counted, accepted = stats[1:].view(3, -1)
        return {"loss": stats[0] / denominator, "correct": correct, "counted": counted, "accepted": accepted,
                **self._update(progress), "tokens": tokens}

    def _graphed(self, progress: Progress) -> dict:
        """The step through its CUDA graph (train.cuda_graphs: one micro-batch, one process)."""
        batch, seed = self.local.next_micro_batch(progress)
        out = self.graphs.run(batch, self.parts.features(batch), seed)
        return {"loss": out["loss_sum"] / out["weight_sum"], "correct": out["correct"], "counted": out["counted"],
                "accepted": out["accepted"], **self._update(progress), "tokens": batch["num_tokens"]}

    def _update(self, progress: Progress) -> dict:
        """Clip, update, advance the schedule; the gradients must already be summed and normalised."""
        p = self.parts
        grad_norm = torch.nn.utils.clip_grad_norm_(p.drafter.parameters(), self.cfg.train.grad_clip)
        lr = p.scheduler.get_last_lr()[0]  # the rate this step uses (the scheduler then moves on)
        p.optimizer.step()
        p.scheduler.step()
        p.optimizer.zero_grad(set_to_none=self.graphs is None)  # the graphs write to fixed .grad
        progress.step += 1
        if progress.step == self.cfg.train.compile_warmup_steps and not self.cfg.data.buckets:
            p.compilation.recompiles.mark_warm()
        return {"grad_norm": grad_norm, "lr": lr}

    def compile_buckets(self) -> int:
        """One forward+backward per bucket shape (synthetic tokens, no update), and the target's
        forward on them where it is compiled (`target.compile`): compiles every graph the run will
        need, so training itself never recompiles. On a GPU the largest step's memory is measured:
        the feature cache leaves that much free, and a step that cannot fit stops here, in one line,
        before training. Returns the shapes compiled."""
        p = self.parts
        gen = torch.Generator().manual_seed(0)
        shapes = bucket_shapes(self.cfg.data)
        if p.target.compiled_here:  # every bucket shape, and the feature cache's fills: any rows, any length
            warm_up_compiled(p.target, shapes, p.stream_layers)
        cuda = p.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(p.device)
            before = torch.cuda.memory_allocated(p.device)
        for rows, length in shapes:
            batch, feats = synthetic_batch(p.target, p.stream_layers, p.device, rows, length, gen)
            task = make_task(batch["input_ids"], batch["loss_mask"], self.cfg.objective, 0)
            try:
                p.forward(task, feats).weighted_ce_sum.backward()
            except torch.OutOfMemoryError:
                raise UserError(_too_large(self.cfg, rows, length, p.device)) from None
            p.drafter.zero_grad(set_to_none=self.graphs is None)
        if cuda:
            p.features.reserve_for_step(torch.cuda.max_memory_allocated(p.device) - before)
        p.compilation.recompiles.mark_warm()
        return len(shapes)

    def prepare(self) -> None:
        """Before the first step: every bucket compiled (train.compile, target.compile) and captured
        (train.cuda_graphs)."""
        if (self.cfg.train.compile or self.parts.target.compiled_here) and self.cfg.data.buckets:
            t = time.perf_counter()
            n = self.compile_buckets()
            log.info("compiled %d bucket shapes in %.1f s (cache was %s)", n, time.perf_counter() - t,
                     self.parts.compilation.cache_state)
        if self.graphs is not None:
            self.graphs.prepare(bucket_shapes(self.cfg.data))
