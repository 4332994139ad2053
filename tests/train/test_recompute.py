"""`train.activation_checkpointing` reaches the drafter a run trains, and the run trains as without it
(the recomputed layers' gradients: tests/draft/test_recompute_layers.py)."""

from __future__ import annotations

import pytest

from dflash_train.train.loop import Trainer
from tiny import tiny_target


def test_the_key_reaches_the_drafter_and_the_steps_are_the_plain_ones(make_run_config):
    losses = []
    for on in (False, True):
        cfg = make_run_config(f"run_{on}", overrides=[f"train.activation_checkpointing={str(on).lower()}"])
        trainer = Trainer(cfg, target=tiny_target(num_layers=4, hidden=64))
        assert trainer.parts.drafter.recompute_layers is on
        losses.append([float(trainer.train_step()["loss"]) for _ in range(3)])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
