"""On CUDA, the held-out probe with the training recipe's settings (compiled draft layers and loss,
flex attention, length buckets, a bf16 target): its scoring reuses the compiled graphs and its
decode replay runs eagerly beside them; neither may recompile them. Run: `python -m pytest tests/gpu -m gpu`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_train.train.loop import Trainer

from tiny import GPU_RECIPE, tiny_target, to_cuda  # tests/ is on sys.path (conftest.py)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_probe_replays_decoding_without_recompiling(make_run_config):
    target = to_cuda(tiny_target(num_layers=4, hidden=64))
    heldout = make_run_config().data.train_files[0]
    cfg = make_run_config(overrides=[
        *GPU_RECIPE, "train.max_steps=12", "train.log_every=2",
        f"eval.heldout_files=[{heldout}]", "eval.heldout_every=4", "eval.heldout_decode_tokens=64"])
    trainer = Trainer(cfg, target=target)
    trainer.fit(progress=False)
    probes = [json.loads(x) for x in (Path(cfg.run_dir) / "heldout.jsonl").read_text().splitlines()]
    assert [p["step"] for p in probes] == [4, 8, 12]
    assert all(p["decode_rounds"] > 0 and p["tau_decode"] >= 1.0 for p in probes)
    metrics = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["recompiles_since_warmup"] for m in metrics] == [0] * len(metrics)
    assert trainer.parts.compilation.recompiles.since_warm == 0
