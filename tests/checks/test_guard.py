import copy
import json
import logging

import pytest

from dflash_train.config import RunConfig
from dflash_train.checks.guard import ThroughputGuard
from dflash_train.checks.manifest import build_manifest, write_manifest

WARMUP = 5


@pytest.fixture(scope="module")
def base_manifest(tmp_path_factory):
    config = RunConfig().model_dump(mode="json")
    return build_manifest(config, ["dflash-train", "train"], tmp_path_factory.mktemp("x"))


def _write_run(runs_root, name, manifest, speeds, truncated_tail=False):
    run_dir = runs_root / name
    manifest = {**copy.deepcopy(manifest), "run_dir": str(run_dir)}
    write_manifest(run_dir, manifest)
    rows = [{"step": step, "tokens_per_s": tps, "loss": 1.0} for step, tps in enumerate(speeds, 1)]
    lines = [json.dumps(row) for row in rows]
    if truncated_tail:
        lines.append('{"step": 99, "tokens_')
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return manifest


def _current(runs_root, manifest):
    return {**copy.deepcopy(manifest), "run_dir": str(runs_root / "now")}


def test_baseline_is_the_best_steady_state_median(tmp_path, base_manifest):
    # Slow warm-up steps must not drag the median; the faster of two earlier runs wins.
    _write_run(tmp_path, "good", base_manifest, [10] * WARMUP + [1000, 990, 1010], truncated_tail=True)
    _write_run(tmp_path, "ok", base_manifest, [10] * WARMUP + [800, 800, 800])
    guard = ThroughputGuard(tmp_path, _current(tmp_path, base_manifest), WARMUP)
    assert guard.baseline.run_dir == tmp_path / "good" and guard.baseline.tokens_per_s == 1000


def test_fires_once_and_names_the_visible_causes(tmp_path, base_manifest, caplog):
    _write_run(tmp_path, "good", base_manifest, [10] * WARMUP + [1000] * 5)
    now = _current(tmp_path, base_manifest)
    now["packages"]["torch"] = "2.9.0+cu126"
    now["packages"]["sglang"] = "0.5.2"
    now["compile_settings"]["environment"]["TORCHINDUCTOR_COORDINATE_DESCENT_TUNING"] = "1"
    now["git"] = {
        "commit": "abc", "dirty": True, "diff_sha256": "f" * 64, "changed_files": ["dflash_train/draft/model.py"]
    }
    guard = ThroughputGuard(tmp_path, now, WARMUP)
    context = {"recompiles_since_warmup": 3, "compile_cache_state": "cold", "attention_backend": "sdpa"}

    assert guard.check(WARMUP, 100, context) is None  # still warming up
    with caplog.at_level(logging.WARNING, logger="dflash_train"):
        message = guard.check(WARMUP + 1, 500, context)
    assert "50%" in message and str(tmp_path / "good") in message
    for cause in ("3 recompile(s)", "compile cache was cold", "packages.torch", "packages.sglang",
                  "compile_settings.environment.TORCHINDUCTOR_COORDINATE_DESCENT_TUNING: <absent> -> 1",
                  "dflash_train/draft/model.py"):
        assert cause in message
    assert [r.getMessage() for r in caplog.records] == [message]
    assert guard.check(WARMUP + 2, 400, context) is None  # loud once, not every step


def test_quiet_within_threshold(tmp_path, base_manifest):
    _write_run(tmp_path, "good", base_manifest, [10] * WARMUP + [1000] * 5)
    guard = ThroughputGuard(tmp_path, _current(tmp_path, base_manifest), WARMUP)
    assert guard.check(WARMUP + 1, 900, {"compile_cache_state": "warm"}) is None


def test_attention_fallback_against_the_best_runs_backend(tmp_path, base_manifest):
    run = _write_run(tmp_path, "good", base_manifest, [])
    rows = [{"step": s, "tokens_per_s": 1000, "attention_backend": "flex"} for s in range(1, 10)]
    (tmp_path / "good" / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    guard = ThroughputGuard(tmp_path, _current(tmp_path, run), WARMUP)
    message = guard.check(WARMUP + 1, 300, {"attention_backend": "sdpa"})
    assert "attention backend is sdpa, the best run used flex" in message


def test_other_hardware_or_config_is_not_compared(tmp_path, base_manifest):
    _write_run(tmp_path, "h100", {**base_manifest, "hardware_fingerprint": "gpu:1xNVIDIA H100"}, [1000] * 10)
    _write_run(tmp_path, "other-cfg", {**base_manifest, "config_fingerprint": "0" * 64}, [1000] * 10)
    guard = ThroughputGuard(tmp_path, _current(tmp_path, base_manifest), WARMUP)
    assert guard.baseline is None
    assert guard.check(WARMUP + 1, 1, {}) is None


def test_own_run_dir_is_not_its_own_baseline(tmp_path, base_manifest):
    now = _write_run(tmp_path, "now", base_manifest, [1000] * 10)
    assert ThroughputGuard(tmp_path, now, WARMUP).baseline is None
