"""`train.cuda_graphs`: the drafter's whole micro-batch step as one CUDA graph per bucket shape.

A small target's step is bound by the host: at SmolLM2's shape the device works ~25 ms of a ~36 ms
step while the host launches ~570 kernels (docs/benchmarks/throughput.md). Everything from the
batch's tokens, loss mask, anchor keys and features to the gradients is device work with static
shapes per bucket: anchors and labels (`task_from_keys`), the block mask, the forward, the chunked
loss and the backward. So it is captured once per bucket shape and replayed; the host then copies
the batch into the graph's input buffers and launches one graph.

Every bucket shape is captured before training (`prepare`, largest first, on synthetic batches).
Gradients accumulate into `.grad` tensors allocated once, outside the graphs, and zeroed in place
after each optimizer step (never set to None: the graphs write to those addresses). All graphs
share one memory pool and one features buffer (only one runs at a time): a replay may overwrite
another graph's outputs, so each step's outputs are read (copied) before the next replay. The
feature cache's reserve grows by the memory the graphs keep.

`capture=False` runs the same step on the same buffers without capturing: the CPU tests check it
against the plain step, and `tests/gpu` checks the captured graphs against both.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from dflash_train.config_model import ObjectiveConfig
from dflash_train.draft.objective import task_from_keys, task_keys
from dflash_train.compiled_steps import capture_graph
from dflash_train.train.build import RunParts
from dflash_train.train.shapes import synthetic_batch

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
    """The run's captured steps, one per batch shape (rows, length, feature width).
    `capture=False`: the same step on the same buffers, run eagerly (buffers made as shapes come)."""

    def __init__(self, parts: RunParts, objective: ObjectiveConfig, capture: bool = True):
        self.parts, self.objective = parts, objective
        self.capture = capture
        self.graphs: dict[tuple, _Graph] = {}
        self.grads: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (parameter, its one .grad, its address)
        self.features_storage: torch.Tensor | None = None
        self.pool = None

    @classmethod
    def for_run(cls, parts: RunParts, objective: ObjectiveConfig, single_process: bool) -> StepGraphs:
        """The run's step graphs, or a clear refusal where they cannot run."""
        if parts.device.type != "cuda":
            raise ValueError(f"train.cuda_graphs runs on CUDA only; this run's device is {parts.device}")
        if not single_process:
            raise ValueError("train.cuda_graphs: single-process training (dflash-train train) only; a "
                             "distributed drafter rank exchanges its sums between micro-batches")
        return cls(parts, objective)

    def prepare(self, shapes: list[tuple[int, int]]) -> None:
        """Captures every bucket shape's step before training, largest first (the shared features
        buffer is sized once). The graphs' memory joins the feature cache's reserve."""
        p = self.parts
        t0, device = time.perf_counter(), p.device
        if self.capture:
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(device)
        gen = torch.Generator().manual_seed(0)
        for rows, length in sorted(set(shapes), key=lambda s: -s[0] * s[1]):
            batch, features = synthetic_batch(p.target, p.stream_layers, device, rows, length, gen)
            self._graph(batch, features, 0)
        if not self.capture:
            return
        torch.cuda.empty_cache()
        kept = max(torch.cuda.memory_reserved(device) - before, 0)
        if p.features.cache is not None:
            p.features.cache.reserve_bytes += kept
        log.info("captured the drafter step of %d bucket shapes as CUDA graphs in %.1f s (%.1f GiB kept)",
                 len(self.graphs), time.perf_counter() - t0, kept / 2**30)

    def run(self, batch: dict, features: torch.Tensor, anchor_seed: int) -> dict:
        """One micro-batch's forward and backward (gradients added to `.grad`). Returns copies of the
        step's sums: loss_sum, correct, counted, accepted (per slot) and weight_sum."""
        if any(p.grad is not grad or p.data_ptr() != address for p, grad, address in self.grads):
            raise RuntimeError("train.cuda_graphs: a parameter or its .grad was replaced (or set to None); "
                               "the captured steps read and write the ones they were captured with")
        g = self._graph(batch, features, anchor_seed)
        if self.capture:
            g.graph.replay()
        else:
            g.outputs = self._step(g)
        return {name: t.clone() for name, t in g.outputs.items()}

    def _graph(self, batch: dict, features: torch.Tensor, anchor_seed: int) -> _Graph:
        """The shape's buffers, loaded with this batch, and its graph (captured the first time)."""
        shape = (*batch["input_ids"].shape, features.shape[-1])
        g = self.graphs.get(shape)
        if g is None:
            g = self._buffers(batch, features)
        g.input_ids.copy_(batch["input_ids"])
        g.loss_mask.copy_(batch["loss_mask"])
        g.features.copy_(features)
        keys = task_keys(tuple(batch["input_ids"].shape), anchor_seed)
        g.keys.copy_(keys.pin_memory() if g.keys.is_cuda else keys, non_blocking=True)
        if shape not in self.graphs:
            if self.capture:
                self._capture(g, shape)
            self.graphs[shape] = g
        return g

    def _buffers(self, batch: dict, features: torch.Tensor) -> _Graph:
        self._allocate_grads()
        ids = batch["input_ids"]
        n = math.prod(features.shape)
        stored = self.features_storage
        if stored is None or stored.numel() < n or stored.dtype != features.dtype or stored.device != features.device:
            stored = self.features_storage = torch.zeros(n, dtype=features.dtype, device=features.device)
        return _Graph(torch.zeros_like(ids), torch.zeros_like(batch["loss_mask"]),
                      torch.zeros(ids.shape, device=ids.device), stored[:n].view(features.shape))

    def _allocate_grads(self) -> None:
        """`.grad` of every trainable parameter, once: the graphs accumulate into these addresses."""
        if self.grads:
            return
        for p in self.parts.drafter.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self.grads.append((p, p.grad, p.data_ptr()))

    def _step(self, g: _Graph) -> dict:
        task = task_from_keys(g.input_ids, g.loss_mask, g.keys, self.objective)
        out = self.parts.forward(task, g.features)
        weight_sum = task.weights.sum().clamp(min=1e-12)
        (out.weighted_ce_sum / weight_sum).backward()
        return {"loss_sum": out.weighted_ce_sum.detach(), "correct": out.correct_per_slot,
                "counted": out.counted_per_slot, "accepted": out.accepted_per_slot, "weight_sum": weight_sum}

    def _capture(self, g: _Graph, shape: tuple) -> None:
        grads = [grad for _, grad, _ in self.grads]
        saved = [grad.clone() for grad in grads]  # the warm-up runs before the capture add to them
        try:
            g.graph, g.outputs = capture_graph(lambda: self._step(g), g.input_ids.device, self.pool)
        except Exception as err:
            raise RuntimeError(f"train.cuda_graphs: capturing the drafter step of shape {shape} failed ({err}); "
                               "train without train.cuda_graphs") from err
        finally:
            torch._foreach_copy_(grads, saved)
        self.pool = g.graph.pool()
