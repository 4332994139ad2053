"""objective.feature_noise: Gaussian noise on the target features while the drafter trains, scaled
per token and target layer by that layer's RMS (against a float64 reference), drawn from the
micro-batch's own seed (so resume and launch layouts leave it unchanged: tests/train/test_resume.py,
tests/distributed), and never in eval mode (held-out probes, evaluation)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_train.draft.objective import make_task, task_from_keys, task_keys
from dflash_train.train.build import build
from dflash_train.train.forward import noise_generator, with_noise
from dflash_train.train.shapes import synthetic_batch


def test_the_noise_follows_each_layers_scale():
    width, scales = 64, torch.tensor([0.01, 1.0, 300.0], dtype=torch.float64)  # three target layers
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4000, 3, width, generator=gen, dtype=torch.float64) * scales[:, None]).flatten(-2)
    noisy = with_noise(x.float(), 0.1, width, torch.Generator().manual_seed(1))
    noise = (noisy.double() - x.float().double()).unflatten(-1, (3, width))
    rms = x.unflatten(-1, (3, width)).pow(2).mean(-1, keepdim=True).sqrt()  # float64, each token's own
    relative = noise / rms
    for layer in range(3):  # the same relative std in every layer, whatever its scale
        assert abs(relative[:, layer].std().item() - 0.1) < 0.003, layer
        assert abs(relative[:, layer].mean().item()) < 0.002, layer


def test_noise_from_the_micro_batchs_seed_only_while_the_drafter_trains(make_run_config, shared_tiny_target):
    cfg = make_run_config(overrides=["objective.feature_noise=0.3"])
    parts = build(cfg, shared_tiny_target)
    clean = replace(parts.forward, feature_noise=0.0)
    assert parts.forward.feature_noise == 0.3
    batch, feats = synthetic_batch(parts.target, parts.stream_layers, parts.device, 2, 48,
                                   torch.Generator().manual_seed(0))
    task, other = (make_task(batch["input_ids"], batch["loss_mask"], cfg.objective, seed) for seed in (5, 6))
    other = replace(task, seed=other.seed)  # the same anchors, another seed: other noise

    def loss(forward, t=task):
        with torch.no_grad():
            return forward(t, feats).weighted_ce_sum

    noisy, reference = loss(parts.forward), loss(clean)
    assert noisy != reference and loss(parts.forward) == noisy and loss(parts.forward, other) != noisy
    with parts.forward.evaluating():  # the held-out probe's and evaluation's mode
        assert torch.equal(loss(parts.forward), loss(clean))
    assert parts.drafter.training
    keyed = task_from_keys(batch["input_ids"], batch["loss_mask"], task_keys((2, 48), 5), cfg.objective)
    with pytest.raises(ValueError, match="needs the micro-batch's seed"):  # the captured step's tasks carry none
        noise_generator(keyed)
