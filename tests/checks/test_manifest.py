import json
import os
import platform
from pathlib import Path

import pytest

from dflash_train.checks.compile_settings import _ENV_PREFIXES
from dflash_train.config import RunConfig
from dflash_train.checks.manifest import build_manifest, config_fingerprint, write_manifest


def _config(**overrides) -> dict:
    return RunConfig(**overrides).model_dump(mode="json")


def test_manifest_records_environment_and_round_trips(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "pinned_use_cuda_host_register:True")
    config = _config(run_dir=str(tmp_path / "run"))
    manifest = build_manifest(config, ["dflash-train", "train", "-c", "x.yaml"], tmp_path / "run")
    path = write_manifest(tmp_path / "run", manifest)
    assert json.loads(path.read_text()) == manifest
    assert manifest["python"] == platform.python_version()
    assert manifest["packages"]["torch"].startswith("2.") and "transformers" in manifest["packages"]
    assert manifest["command"] == ["dflash-train", "train", "-c", "x.yaml"]
    assert manifest["config"] == config
    assert manifest["hardware_fingerprint"].startswith(("cpu:", "gpu:"))
    assert manifest["start_time"].endswith("+00:00")
    # how host memory is pinned is part of the environment a run's speed depends on
    assert manifest["torch"]["alloc_conf"] == {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:True"}


def test_config_fingerprint_ignores_run_specific_keys_only():
    base = config_fingerprint(_config(run_dir="runs/a"))
    assert config_fingerprint(_config(run_dir="runs/b", seed=3, tracking={"run_name": "x"})) == base
    assert config_fingerprint(_config(run_dir="runs/a", train={"lr": 1e-4})) != base
    drop = ["train.lr", "run_dir"]
    assert config_fingerprint(_config(train={"lr": 1e-4}), drop) == config_fingerprint(_config(), drop)


def test_no_secret_values_in_the_manifest(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "supersecret-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "supersecret")
    argv = ["dflash-train", "train", "--wandb-api-key=supersecret", "tracking.token=supersecret"]
    manifest = build_manifest(_config(), argv, tmp_path)
    text = write_manifest(tmp_path, manifest).read_text()
    assert "supersecret" not in text
    assert manifest["credentials"]["s3"] is True
    assert manifest["command"][2] == "--wandb-api-key=<redacted>"


@pytest.fixture
def no_compile_environment(monkeypatch):
    """None of the variables that steer compilation (the test process may hold some: the suite runs
    Triton's interpreter on a CPU, tests/conftest.py); each test sets its own."""
    for name in [n for n in os.environ if n.startswith(_ENV_PREFIXES)]:
        monkeypatch.delenv(name)


def test_the_manifest_records_compile_settings_that_are_not_torchs_defaults(tmp_path, monkeypatch,
                                                                           no_compile_environment):
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # differs between hosts: left out
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")  # set by every compiling run: left out
    assert "coordinate_descent_tuning" not in build_manifest(_config(), [], tmp_path)["compile_settings"]["inductor"]
    with inductor_config.patch(coordinate_descent_tuning=True, max_autotune_gemm=True):
        settings = build_manifest(_config(), [], tmp_path)["compile_settings"]
    assert settings["inductor"]["coordinate_descent_tuning"] is True and settings["inductor"]["max_autotune_gemm"] is True
    assert settings["environment"]["TORCHINDUCTOR_MAX_AUTOTUNE"] == "1"
    assert settings["environment"] == {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}


def test_torchs_own_ptxas_is_not_recorded_but_another_one_is(tmp_path, monkeypatch, no_compile_environment):
    """torch names the ptxas it ships in the environment of whichever process compiles a kernel
    (not one whose kernels all come from the cache); a ptxas the user chose is a real difference."""
    import torch

    for own in (Path(torch.__file__).parent / "bin" / "ptxas", Path(torch.__file__).parent / "_inductor" / "bin" / "ptxas"):
        monkeypatch.setenv("TRITON_PTXAS_PATH", str(own))  # torch 2.11's place, and a later release's
        assert build_manifest(_config(), [], tmp_path)["compile_settings"]["environment"] == {}
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/usr/local/cuda/bin/ptxas")
    assert build_manifest(_config(), [], tmp_path)["compile_settings"]["environment"] == {
        "TRITON_PTXAS_PATH": "/usr/local/cuda/bin/ptxas"}
