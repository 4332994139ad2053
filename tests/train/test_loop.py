"""Tiny end-to-end training on CPU: the loss falls and metrics.jsonl carries what users read."""

from __future__ import annotations

import json

import pytest

from dflash_train.train.checkpoint import latest_checkpoint
from dflash_train.train.loop import Trainer
from dflash_train.train.metrics import read_metrics
from dflash_train.train.optim import lr_factor


def test_tiny_training_learns_and_logs(make_run_config, shared_tiny_target):
    cfg = make_run_config(overrides=["train.max_steps=30", "train.lr=1e-2"])
    trainer = Trainer(cfg, target=shared_tiny_target)
    summary = trainer.fit(progress=False)
    assert summary["steps"] == 30
    records = read_metrics(cfg.run_dir)
    assert [r["step"] for r in records] == list(range(1, 31))
    for r in records:
        for key in ("loss", "acc", "tau_hat", "tokens_per_s", "lr", "grad_norm"):
            assert key in r, key
        assert len(r["acc"]) == cfg.draft.block_size - 1
        assert 1.0 <= r["tau_hat"] <= cfg.draft.block_size
        assert r["tokens_per_s"] > 0
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    assert records[-1]["tau_hat"] > records[0]["tau_hat"]
    # warmup then decay
    lrs = [r["lr"] for r in records]
    assert lrs[0] < lrs[1] and lrs[-1] < max(lrs)
    assert latest_checkpoint(cfg.run_dir).name == "step_00000030"
    assert json.loads((trainer.run_dir / "summary.json").read_text())["steps"] == 30


def test_logged_lr_is_the_lr_the_step_used(make_run_config, shared_tiny_target):
    cfg = make_run_config(overrides=["train.max_steps=10", "train.warmup_ratio=0.2"])
    Trainer(cfg, target=shared_tiny_target).fit(progress=False)
    logged = [r["lr"] for r in read_metrics(cfg.run_dir)]
    used = [cfg.train.lr * lr_factor(s, 10, 0.2, 0.0) for s in range(10)]
    assert logged == pytest.approx(used)
