"""`target.compile` in a training run: the warm-up runs the compiled target's forward on every bucket
shape, so training recompiles nothing after it (the target's graphs counted with the drafter's), and
the run's manifest says the features came from a compiled target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_train.train.loop import Trainer
from tiny import tiny_target


@pytest.mark.slow(seconds=45)
def test_a_compiled_target_recompiles_nothing_after_the_warm_up(make_run_config):
    torch._dynamo.reset()
    cfg = make_run_config(overrides=["target.compile=true", "data.length_bucket=64", "data.max_length=128",
                                     "train.max_steps=4", "train.log_every=2"])
    trainer = Trainer(cfg, target=tiny_target(num_layers=4, hidden=64))  # its own: this one gets compiled
    trainer.fit(progress=False)
    assert trainer.parts.target.compiled
    metrics = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 4]
    assert [m["recompiles_since_warmup"] for m in metrics] == [0, 0]
    assert trainer.parts.compilation.recompiles.graphs >= 2  # the target's, made in the warm-up
    manifest = json.loads((Path(cfg.run_dir) / "manifest.json").read_text())
    assert manifest["target"]["compiled"] is True
