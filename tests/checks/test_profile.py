"""train.profile_at_step: a profiled window of the real loop, and the summary's arithmetic."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_train.checks.profile import StepProfiler, busy_us, family, summarize
from dflash_train.train.loop import Trainer


def _losses(run_dir) -> list[float]:
    return [json.loads(x)["loss"] for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _summary(run_dir, first: int) -> dict:
    return json.loads((Path(run_dir) / "profile" / f"step_{first:08d}" / "summary.json").read_text())


def test_profiled_window_records_its_steps_and_changes_nothing(make_run_config, shared_tiny_target):
    common = ["train.max_steps=14", "train.log_every=6"]
    plain = make_run_config("plain", common)
    Trainer(plain, target=shared_tiny_target).fit(progress=False)
    # Logs after steps 6 and 12: the first window of 5 from step 4 on with none inside is 7-11 (a log
    # right after its last step is outside it).
    cfg = make_run_config("profiled", [*common, "train.profile_at_step=4"])
    Trainer(cfg, target=shared_tiny_target).fit(progress=False)
    assert _losses(cfg.run_dir) == _losses(plain.run_dir)  # the same run, bit for bit
    summary = _summary(cfg.run_dir, 7)
    assert summary["first_step"] == 7 and summary["steps"] == 5
    assert summary["notes"] == ["starts at step 7, the first at or after 4 with no logging, checkpoint or "
                                "evaluation inside the window"]
    trace = json.loads(gzip.open(Path(cfg.run_dir) / "profile" / "step_00000007" / "trace.json.gz").read())
    marks = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("train_step_")}
    assert marks == {f"train_step_{k}" for k in range(7, 12)}
    # CPU: no kernels, so no device figures; the ATen ops' own time by family, the matmuls among them
    assert summary["device"] == "cpu" and summary["device_busy_ms"] is None and summary["host_syncs"] == 0
    assert summary["wall_ms"] > 0 and summary["families_ms"]["matmul"] > 0
    assert sum(summary["families_ms"].values()) <= summary["wall_ms"] * 1.05


def test_window_cut_short_or_never_reached_is_reported(make_run_config, shared_tiny_target, caplog):
    cfg = make_run_config(overrides=["train.max_steps=3", "train.log_every=100", "train.profile_at_step=2"])
    Trainer(cfg, target=shared_tiny_target).fit(progress=False)
    summary = _summary(cfg.run_dir, 2)
    assert summary["steps"] == 2 and summary["notes"] == ["the run ended after 2 of 5 profiled steps"]
    late = make_run_config("late", ["train.max_steps=3", "train.profile_at_step=9"])
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        Trainer(late, target=shared_tiny_target).fit(progress=False)
    assert "profile_at_step=9: the run ended at step 3, before it; nothing was profiled" in caplog.text
    assert not (Path(late.run_dir) / "profile").exists()


def test_a_failing_step_stops_the_profiler(make_run_config, shared_tiny_target, monkeypatch):
    cfg = make_run_config(overrides=["train.max_steps=6", "train.log_every=100", "train.profile_at_step=2"])
    trainer = Trainer(cfg, target=shared_tiny_target)
    step = trainer.train_step

    def failing():
        if trainer.progress.step == 2:
            raise RuntimeError("boom")
        return step()

    monkeypatch.setattr(trainer, "train_step", failing)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(progress=False)
    assert not torch.autograd._profiler_enabled()
    assert not (Path(cfg.run_dir) / "profile").exists()


def test_quiet_window_search():
    every_6 = lambda s: s % 6 == 0  # noqa: E731
    at_2 = StepProfiler(2, Path("."), torch.device("cpu"), extras=every_6)
    assert at_2._quiet_start(2) == 2 and at_2.notes == []  # steps 2-6: the log after 6 ends the window
    assert StepProfiler(4, Path("."), torch.device("cpu"), extras=every_6)._quiet_start(4) == 7
    always = StepProfiler(3, Path("."), torch.device("cpu"), extras=lambda s: True)
    assert always._quiet_start(3) == 3 and always.notes == ["logging, checkpoints or evaluations ran inside the window"]


def _event(name, device, start, end, own_us, annotation=False):
    kind = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, key=name, device_type=kind, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start, end=end), self_device_time_total=own_us,
                           self_cpu_time_total=0 if device else own_us)


def test_summary_on_a_device_counts_kernels_not_annotations():
    """Each record_function range also shows on the device as a user annotation spanning its kernels
    and the gaps between them: counting it would fill the idle time and double the steps."""
    events = [
        _event("train_step_1", False, 0, 1000, 1000), _event("cudaLaunchKernel", False, 10, 12, 2),
        _event("cuLaunchKernel", False, 20, 22, 2), _event("cudaStreamSynchronize", False, 500, 600, 100),
        # the window's end: the harness's synchronize, then the profiler's own at exit
        _event("cudaDeviceSynchronize", False, 1001, 1100, 99), _event("cudaDeviceSynchronize", False, 1101, 1102, 1),
        _event("train_step_1", True, 100, 800, 700, annotation=True),
        _event("sm90_xmma_gemm_bf16", True, 100, 300, 200), _event("triton_poi_fused_add_0", True, 250, 400, 150),
        _event("triton_per_fused__log_softmax_1", True, 600, 800, 200),
    ]
    prof = SimpleNamespace(events=lambda: events)
    summary = summarize(prof, 1, 1e-3, torch.device("cuda"))  # 1 ms wall
    assert summary["device_busy_ms"] == pytest.approx(0.5)   # 100-400 and 600-800 us
    assert summary["device_idle_ms"] == pytest.approx(0.5)
    assert summary["launches"] == 2 and summary["host_syncs"] == 1  # the step's own, not the window's end
    assert summary["families_ms"] == {"matmul": 0.2, "softmax / cross-entropy": 0.2, "elementwise / other": 0.15}


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
