"""The drafter's loss on one micro-batch, in the run's precision and attention path.

One object, because training, the compile warm-up, the CUDA-graphed step and the held-out probe must
all run the very same forward: a probe that ran another path would score a drafter nobody trains,
and a compiled layer shown another call would recompile.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from dflash_train.config import RunConfig
from dflash_train.config_model import ObjectiveConfig
from dflash_train.draft.fp8_head import Fp8Head
from dflash_train.draft.acceptance import BlockLoss
from dflash_train.draft.loss import LossMix, loss_chunk_rows
from dflash_train.draft.model import DFlashDraftModel
from dflash_train.draft.objective import BlockTask, draft_loss
from dflash_train.targets.model import Target
from dflash_train.train.shapes import autocast_for


def loss_mix(objective: ObjectiveConfig) -> LossMix:
    """The loss mix `objective` asks for: its terms, and D-PACE and the selector's options as set."""
    dpace_alpha = objective.dpace_alpha if objective.slot_weights == "dpace" else None
    return LossMix.from_weights(objective.loss, objective.kd_temperature, dpace_alpha,
                                objective.selector_outside_top_k == "join", objective.selector_weights == "slot")


@dataclass
class DraftForward:
    drafter: DFlashDraftModel
    target: Target
    device: torch.device
    loss_mix: LossMix
    use_flex: bool
    chunk_rows: int
    """Rows of logits formed at a time (objective.ce_chunk_size, or the vocabulary's default)."""
    compiled_loss: bool
    ce_kernel: str
    even_chunks: bool
    """Length buckets repeat the loss's row counts: even chunks give one compiled graph per bucket."""
    fp8_head: Fp8Head | None = None
    """The target's head quantised once for the loss (train.fp8_lm_head), else None: its weight as is."""
    feature_noise: float = 0.0
    """objective.feature_noise: added to the features while the drafter trains, never in eval mode."""

    @classmethod
    def for_run(cls, cfg: RunConfig, drafter: DFlashDraftModel, target: Target, device: torch.device,
                use_flex: bool) -> DraftForward:
        return cls(drafter, target, device, loss_mix(cfg.objective),
                   use_flex, loss_chunk_rows(cfg.objective.ce_chunk_size, target.vocab_size),
                   cfg.train.compile_loss, cfg.train.ce_kernel, bool(cfg.data.buckets),
                   Fp8Head(target.lm_head_weight) if cfg.train.fp8_lm_head else None, cfg.objective.feature_noise)

    @property
    def attention_backend(self) -> str:
        return "flex" if self.use_flex else "sdpa"

    def autocast(self):
        """The run's autocast, a new context each time: an evaluation's wraps the forward's, and one
        autocast object entered twice restores the wrong state on exit (left on after an eval)."""
        return autocast_for(self.device, self.target.embed_weight.dtype)

    def __call__(self, task: BlockTask, features: torch.Tensor) -> BlockLoss:
        if self.feature_noise and self.drafter.training:
            features = with_noise(features, self.feature_noise, self.target.hidden_size, noise_generator(task))
        with self.autocast():
            t = self.target
            head = t.lm_head_weight if self.fp8_head is None else self.fp8_head
            return draft_loss(self.drafter, task, features, t.embed_weight, head, self.use_flex,
                              self.chunk_rows, self.loss_mix, t.logits, compiled_loss=self.compiled_loss,
                              ce_kernel=self.ce_kernel, even_chunks=self.even_chunks)

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """The drafter in eval mode under the run's autocast (fp32 weights, bf16 target features on
        GPU), then back to training."""
        self.drafter.eval()
        try:
            with self.autocast():
                yield
        finally:
            self.drafter.train()


NOISE_SEED = 0x5EED_0001
"""Added to a micro-batch's seed for its noise: a stream apart from its anchors'."""


def noise_generator(task: BlockTask) -> torch.Generator:
    """The micro-batch's own generator on its device, from its seed: as with its anchors, neither a
    resume nor the ranks' layout changes its noise."""
    if task.seed is None:
        raise ValueError("objective.feature_noise needs the micro-batch's seed (make_task); this task has none")
    return torch.Generator(task.input_ids.device).manual_seed(task.seed + NOISE_SEED)


def with_noise(features: torch.Tensor, scale: float, width: int, generator: torch.Generator) -> torch.Tensor:
    """`features` [..., K * width] plus Gaussian noise of std `scale` x the RMS of each `width` slice
    (one target layer of one token: layers differ in scale by orders of magnitude), drawn from
    `generator` in the features' dtype."""
    x = features.unflatten(-1, (-1, width))
    rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32) / width ** 0.5
    noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return (x + noise * (scale * rms).to(x.dtype)).flatten(-2)
