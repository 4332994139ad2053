"""Same seed, same run: nothing drawn from the global RNG before or during the target's loading (its
one-time GGUF conversion initialises a model) changes the drafter's init, its batches or anchors."""

from __future__ import annotations

import torch

from dflash_train.draft.objective import make_task
from dflash_train.train.loop import Trainer


def test_drafter_init_ignores_rng_draws_of_the_target_load(make_run_config, shared_tiny_target, monkeypatch):
    """Failed before: the seed was set before load_target, so a conversion in this process moved it."""
    cfg = make_run_config()
    plain = Trainer(cfg, target=shared_tiny_target).parts.drafter.state_dict()

    def converting_load(target_cfg, device):
        torch.rand(1000)  # what building a model to convert into does to the global RNG
        return shared_tiny_target

    monkeypatch.setattr("dflash_train.train.inputs.load_target", converting_load)
    converted = Trainer(cfg).parts.drafter.state_dict()
    assert plain.keys() == converted.keys()
    for name in plain:
        assert torch.equal(plain[name], converted[name]), name


def test_batches_and_anchors_ignore_the_global_rng(make_run_config, shared_tiny_target):
    cfg = make_run_config()
    seen = []
    for global_seed in (1, 2):
        trainer = Trainer(cfg, target=shared_tiny_target)
        torch.manual_seed(global_seed)
        batch, seed = trainer.stepper.local.next_micro_batch(trainer.progress)
        task = make_task(batch["input_ids"], batch["loss_mask"], cfg.objective, seed)
        seen.append((batch["indices"], seed, task.anchors))
    assert seen[0][:2] == seen[1][:2]
    assert torch.equal(seen[0][2], seen[1][2])
