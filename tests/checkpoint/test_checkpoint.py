"""Checkpoint contents, interrupted saves, retention."""

from __future__ import annotations

import json

from safetensors import safe_open

from dflash_train.checkpoint import local as ckpt
from dflash_train.train.loop import Trainer


def export_names(num_layers: int) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return names


def test_checkpoint_files_hold_the_drafter_only(make_run_config, shared_tiny_target):
    cfg = make_run_config(overrides=["train.max_steps=2", "draft.num_layers=2"])
    trainer = Trainer(cfg, target=shared_tiny_target)
    trainer.fit(progress=False)
    path = ckpt.latest_checkpoint(cfg.run_dir)
    assert path.name == "step_00000002"
    assert {p.name for p in path.iterdir()} >= {"model.safetensors", "draft_config.json", "optimizer.pt",
                                               "trainer_state.json", "config.yaml"}
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        fc = f.get_tensor("fc.weight")
    assert names == export_names(2)
    assert not any("embed" in n or "lm_head" in n for n in names)
    h = shared_tiny_target.hidden_size
    assert tuple(fc.shape) == (h, 2 * h)
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["compatibility"]["target_layer_ids"] == [0, 2]
    cfg_json = json.loads((path / "draft_config.json").read_text())
    assert cfg_json["block_size"] == 4 and cfg_json["mask_token_id"] == 259


def test_interrupted_save_is_ignored(make_run_config, shared_tiny_target):
    cfg = make_run_config(overrides=["train.max_steps=2", "checkpoint.every=1"])
    Trainer(cfg, target=shared_tiny_target).fit(progress=False)
    root = ckpt.checkpoints_dir(cfg.run_dir)
    leftover = root / ".tmp_step_00000009"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half a file")
    assert ckpt.latest_checkpoint(cfg.run_dir) == root / "step_00000002"
    assert [p.name for p in ckpt.list_checkpoints(cfg.run_dir)] == ["step_00000001", "step_00000002"]


def test_keep_last_prunes_old_checkpoints(make_run_config, shared_tiny_target):
    cfg = make_run_config(overrides=["train.max_steps=5", "checkpoint.every=1", "checkpoint.keep_last=2"])
    Trainer(cfg, target=shared_tiny_target).fit(progress=False)
    assert [p.name for p in ckpt.list_checkpoints(cfg.run_dir)] == ["step_00000004", "step_00000005"]
    assert not any(p.name.startswith(".") for p in ckpt.checkpoints_dir(cfg.run_dir).iterdir())


def test_load_refuses_a_non_checkpoint(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        ckpt.load_checkpoint(tmp_path)


def test_snapshot_is_detached_from_later_training(make_run_config, shared_tiny_target, tmp_path):
    """A background write must hold the state of the step it was taken at: the optimizer updates
    weights and AdamW moments in place (on CPU too) while the write is still running."""
    import torch

    trainer = Trainer(make_run_config(overrides=["train.max_steps=3"]), target=shared_tiny_target)
    trainer.train_step()
    snap = ckpt.snapshot(trainer.parts.drafter, trainer.parts.optimizer, trainer.parts.scheduler, {"cursor": [0, 1]})
    weights = {k: v.clone() for k, v in trainer.parts.drafter.state_dict().items()}
    moments = {i: s["exp_avg"].clone() for i, s in trainer.parts.optimizer.state_dict()["state"].items()}
    trainer.train_step()
    assert any(not torch.equal(v, weights[k]) for k, v in trainer.parts.drafter.state_dict().items())
    loaded = ckpt.load_checkpoint(ckpt.write_checkpoint(tmp_path, 1, snap))
    assert loaded["model"].keys() == weights.keys()
    for k, v in weights.items():
        assert torch.equal(loaded["model"][k], v), k
    for i, m in moments.items():
        assert torch.equal(loaded["optim"]["optimizer"]["state"][i]["exp_avg"], m), i
    assert loaded["state"]["step"] == 1 and loaded["state"]["cursor"] == [0, 1]


def test_a_failed_background_write_stops_training(make_run_config, shared_tiny_target, monkeypatch):
    def disk_full(*args):
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt, "write_checkpoint", disk_full)
    cfg = make_run_config(overrides=["train.max_steps=4", "checkpoint.every=1"])
    import pytest

    with pytest.raises(RuntimeError, match="writing a checkpoint failed: No space left on device"):
        Trainer(cfg, target=shared_tiny_target).fit(progress=False)
