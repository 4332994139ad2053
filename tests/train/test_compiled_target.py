"""`target.compile` in a training run: the warm-up runs the compiled target's forward on every bucket
shape and on a single row, so neither the bucketed batches nor the feature cache's fills (any number
of rows, unpadded) compile anything after it; the manifest says the features came from a compiled
target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from dflash_train.train.batches import collate, collate_as_trained
from dflash_train.train.build import build
from dflash_train.train.loop import Trainer
from dflash_train.train.shapes import bucket_shapes
from dflash_train.train.step import TrainStep
from tiny import tiny_target


@pytest.mark.slow(seconds=45)
def test_the_warm_up_makes_every_graph_of_a_compiled_target(make_run_config):
    torch._dynamo.reset()
    counters.clear()
    cfg = make_run_config(overrides=["target.compile=true", "data.length_bucket=64", "data.max_length=128"])
    assert bucket_shapes(cfg.data) == [(3, 64), (1, 128)]
    parts = build(cfg, tiny_target(num_layers=4, hidden=64))  # its own target: this one gets compiled
    assert parts.target.compiled
    TrainStep(cfg, parts).prepare()  # the warm-up (train.compile is off: the target alone compiles)
    warm = counters["stats"]["unique_graphs"]
    assert warm == 3  # the first bucket's, then symbolic ones: any rows and length, and a single row
    batches = [indices for epoch in parts.epoch_batches for indices in epoch]
    assert {len(indices) for indices in batches} >= {1, 3}
    for indices in batches:
        parts.target.features(collate_as_trained(parts.dataset, indices, parts.device, cfg.data)["input_ids"],
                               parts.stream_layers)
    for rows in ([0], [1, 2], [3, 4, 5, 6, 7], [8, 9, 10]):  # the feature cache's fills: unpadded, any number of rows
        parts.target.features(collate(parts.dataset, rows, parts.device)["input_ids"], parts.stream_layers)
    assert counters["stats"]["unique_graphs"] == warm and not counters["graph_break"]


@pytest.mark.slow(seconds=30)
def test_a_run_with_a_compiled_target_records_it(make_run_config):
    cfg = make_run_config(overrides=["target.compile=true", "train.max_steps=2"])
    trainer = Trainer(cfg, target=tiny_target(num_layers=4, hidden=64))
    trainer.fit(progress=False)
    manifest = json.loads((Path(cfg.run_dir) / "manifest.json").read_text())
    assert trainer.parts.target.compiled and manifest["target"]["compiled"] is True
