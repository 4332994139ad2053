"""On CUDA, train.profile_at_step over the training recipe's settings (compiled draft layers and loss,
flex attention, length buckets, a bf16 target): the summary counts kernels, launches and the device's
busy time, not torch.profiler's own annotation ranges. Run: `python -m pytest tests/gpu -m gpu`."""

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


def test_profile_of_compiled_steps_on_the_gpu(make_run_config):
    target = to_cuda(tiny_target(num_layers=4, hidden=64))
    cfg = make_run_config(overrides=[
        *GPU_RECIPE, "train.max_steps=14", "train.log_every=7",
        "train.profile_at_step=2"])
    Trainer(cfg, target=target).fit(progress=False)
    summary = json.loads((Path(cfg.run_dir) / "profile" / "step_00000002" / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["steps"] == 5 and summary["notes"] == []
    assert 0 < summary["device_busy_ms"] <= summary["wall_ms"] and summary["device_idle_ms"] >= 0
    assert summary["launches"] > 10  # compiled layers launch Triton kernels through the driver API
    assert summary["families_ms"]["matmul"] > 0 and summary["families_ms"]["attention"] > 0
    assert not any(name.startswith("train_step_") for _, name in summary["top_ms"])
