"""train.profile_at_step: a profiled window of the real loop, and the summary's arithmetic."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from dflash_train.ops.profile import busy_us, family
from dflash_train.train.loop import Trainer


def _losses(run_dir) -> list[float]:
    return [json.loads(x)["loss"] for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_profiled_window_records_its_steps_and_changes_nothing(make_run_config, shared_tiny_target):
    plain = make_run_config("plain", ["train.max_steps=8"])
    Trainer(plain, target=shared_tiny_target).fit(progress=False)
    cfg = make_run_config("profiled", ["train.max_steps=8", "train.profile_at_step=3"])
    Trainer(cfg, target=shared_tiny_target).fit(progress=False)
    assert _losses(cfg.run_dir) == _losses(plain.run_dir)  # the same run, bit for bit
    out = Path(cfg.run_dir) / "profile"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["first_step"] == 3 and summary["steps"] == 5 and "note" not in summary
    trace = json.loads(gzip.open(out / "trace.json.gz").read())
    marks = sorted({e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("train_step_")})
    assert marks == [f"train_step_{k}" for k in range(3, 8)]
    # CPU: no kernels, so no device figures; the ATen ops' own time by family, the matmuls among them
    assert summary["device"] == "cpu" and summary["device_busy_ms"] is None
    assert summary["wall_ms"] > 0 and summary["families_ms"]["matmul"] > 0
    assert sum(summary["families_ms"].values()) <= summary["wall_ms"] * 1.05


def test_a_window_the_run_never_reaches_is_reported(make_run_config, shared_tiny_target, caplog):
    cfg = make_run_config(overrides=["train.max_steps=3", "train.profile_at_step=2"])
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        Trainer(cfg, target=shared_tiny_target).fit(progress=False)
    summary = json.loads((Path(cfg.run_dir) / "profile" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["note"] == "the run ended after 2 of 5 profiled steps"
    late = make_run_config("late", ["train.max_steps=3", "train.profile_at_step=9"])
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        Trainer(late, target=shared_tiny_target).fit(progress=False)
    assert "profile_at_step=9: this run did not go through that step (it ended at step 3)" in caplog.text
    assert not (Path(late.run_dir) / "profile").exists()


@pytest.mark.parametrize("intervals, expected", [
    ([], 0.0),
    ([(0, 10)], 10.0),
    ([(0, 10), (20, 25)], 15.0),          # a gap is not busy
    ([(0, 10), (5, 12)], 12.0),           # overlap (two streams) counts once
    ([(5, 12), (0, 10), (1, 2)], 12.0),   # any order, nested
])
def test_busy_is_the_union_of_kernel_intervals(intervals, expected):
    brute = sum(1 for t in range(0, 40) if any(s <= t < e for s, e in intervals))  # 1-us grid
    assert busy_us(intervals) == expected == brute


def test_kernel_families():
    assert family("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert family("triton_per_fused__log_softmax_0") == "softmax / cross-entropy"
    assert family("aten::mm") == "matmul"
    assert family("multi_tensor_apply_kernel") == "optimizer"
    assert family("triton_poi_fused_add_mul_silu_3") == "elementwise / other"
