"""Resume is exact: 2N straight steps == N steps + resume(latest) + N steps, loss for loss."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dflash_train.checkpoint.local import latest_checkpoint
from dflash_train.train.loop import Trainer
from dflash_train.train.metrics import read_metrics

N = 3


@pytest.mark.parametrize("grad_accum, noise", [(1, 0.0), (2, 0.0), (2, 0.5)])
def test_resume_reproduces_straight_run_exactly(make_run_config, shared_tiny_target, grad_accum, noise):
    """With objective.feature_noise too: its draws come from each micro-batch's seed."""
    common = [f"train.max_steps={2 * N}", f"train.grad_accum={grad_accum}", "train.warmup_ratio=0.3",
              f"objective.feature_noise={noise}"]
    straight_cfg = make_run_config("straight", common + [f"checkpoint.every={N}"])
    Trainer(straight_cfg, target=shared_tiny_target).fit(progress=False)
    straight = read_metrics(straight_cfg.run_dir)
    assert [r["step"] for r in straight] == list(range(1, 2 * N + 1))

    # A run interrupted after N steps (its last act: a checkpoint), then a fresh process resumes it.
    cfg = make_run_config("interrupted", common)
    first = Trainer(cfg, target=shared_tiny_target)
    first_losses = [float(first.train_step()["loss"]) for _ in range(N)]
    first.checkpointer.save(first.progress, wait=True)
    del first
    resumed = Trainer(cfg, target=shared_tiny_target)
    resumed.resume(latest_checkpoint(cfg.run_dir))
    assert resumed.progress.step == N
    resumed.fit(progress=False)
    second = read_metrics(cfg.run_dir)

    assert first_losses == [r["loss"] for r in straight[:N]]
    assert [r["step"] for r in second] == list(range(N + 1, 2 * N + 1))
    for a, b in zip(second, straight[N:]):
        assert a["loss"] == b["loss"], (a["step"], a["loss"], b["loss"])
        assert a["acc"] == b["acc"] and a["lr"] == b["lr"] and a["grad_norm"] == b["grad_norm"]


def test_resume_from_periodic_checkpoint_rewrites_later_metrics(make_run_config, shared_tiny_target):
    """Copy a finished run, resume it from its step-N checkpoint: metrics.jsonl ends identical, no duplicates."""
    cfg = make_run_config("a", [f"train.max_steps={2 * N}", f"checkpoint.every={N}"])
    Trainer(cfg, target=shared_tiny_target).fit(progress=False)
    reference = read_metrics(cfg.run_dir)
    copy = make_run_config("b", [f"train.max_steps={2 * N}", f"checkpoint.every={N}"])
    shutil.copytree(cfg.run_dir, copy.run_dir)
    trainer = Trainer(copy, target=shared_tiny_target)
    trainer.resume(f"{copy.run_dir}/checkpoints/step_{N:08d}")
    trainer.fit(progress=False)
    again = read_metrics(copy.run_dir)
    assert [r["step"] for r in again] == list(range(1, 2 * N + 1))
    assert [r["loss"] for r in again] == [r["loss"] for r in reference]


def test_a_restart_without_a_checkpoint_records_each_step_once(make_run_config, shared_tiny_target):
    """A run that crashed before its first checkpoint and starts again (`--resume auto` finds
    nothing) must not append its steps after the crashed run's: metrics.jsonl holds each step once."""
    cfg = make_run_config("a", [f"train.max_steps={N}", "checkpoint.every=1000"])
    crashed = Trainer(cfg, target=shared_tiny_target)
    crashed.fit(progress=False)
    for path in (Path(cfg.run_dir) / "checkpoints").iterdir():  # as if it died before saving
        shutil.rmtree(path)
    Trainer(cfg, target=shared_tiny_target).fit(progress=False)
    assert [r["step"] for r in read_metrics(cfg.run_dir)] == list(range(1, N + 1))


@pytest.mark.parametrize(
    "change,field",
    [(["objective.block_size=8"], "block_size"), (["draft.target_layer_ids=[1, 2]"], "target_layer_ids"),
     (["draft.num_layers=2"], "num_draft_layers")],
)
def test_resume_with_a_different_setup_is_refused(make_run_config, shared_tiny_target, change, field):
    cfg = make_run_config("r", ["train.max_steps=1"])
    Trainer(cfg, target=shared_tiny_target).fit(progress=False)
    other = Trainer(make_run_config("r", ["train.max_steps=1"] + change), target=shared_tiny_target)
    with pytest.raises(ValueError, match=f"cannot resume.*\\n.*{field}"):
        other.resume(latest_checkpoint(cfg.run_dir))


def test_resume_into_a_longer_run_follows_the_longer_schedule(make_run_config, shared_tiny_target):
    from dflash_train.train.optim import lr_factor

    short = make_run_config("run", ["train.max_steps=3"])
    Trainer(short, target=shared_tiny_target).fit(progress=False)
    longer = make_run_config("run", ["train.max_steps=6"])
    trainer = Trainer(longer, target=shared_tiny_target)
    trainer.resume(latest_checkpoint(longer.run_dir))
    trainer.fit(progress=False)
    lr = {m["step"]: m["lr"] for m in read_metrics(longer.run_dir)}
    tc = longer.train
    for step in (4, 5, 6):  # no jump to the short run's final 0 learning rate
        assert lr[step] == pytest.approx(tc.lr * lr_factor(step - 1, 6, tc.warmup_ratio, tc.min_lr_ratio))
