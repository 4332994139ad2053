"""`train.cuda_graphs`: the drafter's whole micro-batch step as one CUDA graph per bucket shape.

A small target's step is bound by the host: at SmolLM2's shape the device works ~25 ms of a ~36 ms
step while the host launches ~570 kernels (docs/benchmarks/throughput.md). Everything from the
batch's tokens, loss mask, anchor keys and features to the gradients is device work with static
shapes per bucket: anchors and labels (`task_from_keys`), the block mask, the forward, the chunked
loss and the backward. So it is captured once per bucket shape and replayed; the host then copies
the batch into the graph's input buffers and launches one graph.

Gradients accumulate into `.grad` tensors allocated once, outside the graphs, and zeroed in place
after each optimizer step (never set to None: the graphs write to those addresses). All graphs
share one memory pool: a replay may overwrite another graph's outputs, so each step's outputs are
read (copied) before the next replay.

`capture=False` runs the same step on the same buffers without capturing: the CPU tests check it
against the plain step, and `tests/gpu` checks the captured graphs against both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from dflash_train.draft.objective import task_from_keys, task_keys
from dflash_train.static_cache import capture_graph
from dflash_train.train.accumulate import LocalSource, NoReduction

log = logging.getLogger("dflash_train")

@dataclass
class _Graph:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    keys: torch.Tensor
    features: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    outputs: dict = field(default_factory=dict)


class StepGraphs:
    """The trainer's captured steps, one per batch shape (rows, length, feature width), captured the
    first time a shape comes. `capture=False`: the same step on the same buffers, run eagerly."""

    def __init__(self, trainer, capture: bool = True):
        self.trainer = trainer
        self.capture = capture
        self.graphs: dict[tuple, _Graph] = {}
        self.grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its one .grad)
        self.pool = None

    @classmethod
    def for_trainer(cls, trainer) -> StepGraphs:
        """The trainer's step graphs, or a clear refusal where they cannot run."""
        if trainer.device.type != "cuda":
            raise ValueError(f"train.cuda_graphs runs on CUDA only; this run's device is {trainer.device}")
        if not (isinstance(trainer.source, LocalSource) and isinstance(trainer.reduction, NoReduction)):
            raise ValueError("train.cuda_graphs: single-process training (dflash-train train) only; a "
                             "distributed drafter rank exchanges its sums between micro-batches")
        return cls(trainer)

    def run(self, batch: dict, features: torch.Tensor, anchor_seed: int) -> dict:
        """One micro-batch's forward and backward (gradients added to `.grad`). Returns copies of the
        step's sums: loss_sum, correct, counted, accepted (per slot) and weight_sum."""
        if any(p.grad is not grad for p, grad in self.grads):
            raise RuntimeError("train.cuda_graphs: a parameter's .grad was replaced or set to None; the "
                               "captured steps write to the one allocated first")
        shape = (*batch["input_ids"].shape, features.shape[-1])
        g = self.graphs.get(shape)
        if g is None:
            g = self.graphs[shape] = self._buffers(batch, features)
        g.input_ids.copy_(batch["input_ids"])
        g.loss_mask.copy_(batch["loss_mask"])
        g.features.copy_(features)
        keys = task_keys(tuple(batch["input_ids"].shape), anchor_seed)
        g.keys.copy_(keys.pin_memory() if g.keys.is_cuda else keys, non_blocking=True)
        if not self.capture:
            g.outputs = self._step(g)
        elif g.graph is None:
            self._capture(g, shape)
            g.graph.replay()
        else:
            g.graph.replay()
        return {name: t.clone() for name, t in g.outputs.items()}

    def _buffers(self, batch: dict, features: torch.Tensor) -> _Graph:
        self._allocate_grads()
        ids = batch["input_ids"]
        return _Graph(torch.zeros_like(ids), torch.zeros_like(batch["loss_mask"]),
                      torch.zeros(ids.shape, device=ids.device), torch.zeros_like(features))

    def _allocate_grads(self) -> None:
        """`.grad` of every trainable parameter, once: the graphs accumulate into these addresses."""
        if self.grads:
            return
        for p in self.trainer.drafter.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self.grads.append((p, p.grad))

    def _step(self, g: _Graph) -> dict:
        t = self.trainer
        task = task_from_keys(g.input_ids, g.loss_mask, g.keys, t.cfg.objective)
        out = t.draft_forward(task, g.features)
        weight_sum = task.weights.sum().clamp(min=1e-12)
        (out.weighted_ce_sum / weight_sum).backward()
        return {"loss_sum": out.weighted_ce_sum.detach(), "correct": out.correct_per_slot,
                "counted": out.counted_per_slot, "accepted": out.accepted_per_slot, "weight_sum": weight_sum}

    def _capture(self, g: _Graph, shape: tuple) -> None:
        grads = [grad for _, grad in self.grads]
        saved = [grad.clone() for grad in grads]  # the warm-up runs before the capture add to them
        g.graph, g.outputs = capture_graph(lambda: self._step(g), g.input_ids.device, self.pool)
        self.pool = g.graph.pool()
        torch._foreach_copy_(grads, saved)
        log.info("captured the drafter step of shape %s as a CUDA graph (%d so far)", shape, len(self.graphs))
