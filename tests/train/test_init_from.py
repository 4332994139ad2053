"""draft.init_from: a run starts from an exported drafter's (or a checkpoint's) weights, of the same
setup only, with a fresh optimizer and schedule."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.eval.export import export_drafter
from dflash_train.checkpoint.local import latest_checkpoint
from dflash_train.train.loop import Trainer


@pytest.fixture
def trained(make_run_config, shared_tiny_target):
    """The last checkpoint of a 2-step run (its weights differ from any fresh init)."""
    cfg = make_run_config("source", ["train.max_steps=2", "seed=7"])
    Trainer(cfg, target=shared_tiny_target).fit(progress=False)
    return latest_checkpoint(cfg.run_dir)


def test_init_from_an_export_gives_its_weights(make_run_config, shared_tiny_target, trained, tmp_path):
    out = export_drafter(trained, tmp_path / "export")
    trainer = Trainer(make_run_config("warm", [f"draft.init_from={out}"]), target=shared_tiny_target)
    exported = load_file(out / "model.safetensors")
    state = trainer.parts.drafter.state_dict()
    assert state.keys() == exported.keys()
    for name, t in exported.items():
        assert torch.equal(state[name], t.float()), name  # the export's bf16 values, exactly
    assert trainer.progress.step == 0 and not trainer.parts.optimizer.state  # the optimizer starts fresh
    assert trainer.parts.scheduler.last_epoch == 0


def test_init_from_a_checkpoint_gives_its_exact_weights(make_run_config, shared_tiny_target, trained):
    trainer = Trainer(make_run_config("warm", [f"draft.init_from={trained}"]), target=shared_tiny_target)
    saved = load_file(trained / "model.safetensors")
    fresh = Trainer(make_run_config("fresh"), target=shared_tiny_target).parts.drafter.state_dict()
    for name, t in trainer.parts.drafter.state_dict().items():
        assert torch.equal(t, saved[name]), name
    assert any(not torch.equal(saved[n], fresh[n]) for n in saved)  # so the check above means something


@pytest.mark.parametrize(
    "change,field",
    [("objective.block_size=8", "block_size"), ("draft.target_layer_ids=[1, 2]", "target_layer_ids"),
     ("draft.num_layers=2", "num_hidden_layers"), ("objective.mask_token_id=3", "mask_token_id")],
)
def test_init_from_another_setup_names_the_field(make_run_config, shared_tiny_target, trained, change, field):
    cfg = make_run_config("warm", [f"draft.init_from={trained}", change])
    with pytest.raises(ValueError, match=f"draft.init_from: cannot warm-start.*\\n  {field}: "):
        Trainer(cfg, target=shared_tiny_target)


def test_a_dspark_run_starts_as_the_dflash_drafter_it_holds(make_run_config, shared_tiny_target, trained):
    """A DFlash checkpoint warm-starts a DSpark drafter: its weights exactly, and a zero Markov
    projection, so the chain drafts as the DFlash drafter until trained."""
    overrides = [f"draft.init_from={trained}", "draft.family=dspark", "draft.dspark.markov_rank=4"]
    trainer = Trainer(make_run_config("spark", overrides), target=shared_tiny_target)
    state = trainer.parts.drafter.state_dict()
    for name, t in load_file(trained / "model.safetensors").items():
        assert torch.equal(state[name], t), name
    assert not state["markov_head.markov_w2.weight"].any() and state["markov_head.markov_w1.weight"].any()
