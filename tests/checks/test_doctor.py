import json
import sys

from dflash_train.config import RunConfig
from dflash_train.checks.doctor import format_report, run_doctor

from .conftest import make_dist


def _check(report, name):
    return next(c for c in report.checks if c.name == name)


def test_this_environment_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    report = run_doctor(RunConfig(run_dir=str(tmp_path / "run")))
    assert report.exit_code == 0, format_report(report)
    assert _check(report, "foreign packages").status == "ok"
    assert _check(report, "torch installs").status == "ok"
    assert {c.name for c in report.checks} >= {
        "python", "torch", "pinned dependencies", "gpus", "code", "compile cache", "kernel tuning", "credentials", "disk"
    }
    assert _check(report, "kernel tuning").status == "ok"


def test_inference_package_in_the_env_is_a_warning(tmp_path):
    site = tmp_path / "site"
    make_dist(site, "sglang", "0.5.2")
    make_dist(site, "flashinfer-python", "0.4.0")
    report = run_doctor(paths=[str(site), *sys.path])
    check = _check(report, "foreign packages")
    assert check.status == "warn"
    assert "sglang==0.5.2" in check.detail and "flashinfer-python==0.4.0" in check.detail
    assert report.exit_code == 0  # a warning, not a failure
    assert "[WARN] foreign packages" in format_report(report)


def test_second_torch_build_fails(tmp_path):
    site = tmp_path / "site"
    make_dist(site, "torch", "2.9.0+cu128", top_level="torch\ntorchgen")
    report = run_doctor(paths=[str(site), *sys.path])
    check = _check(report, "torch installs")
    assert check.status == "fail" and "2.9.0+cu128" in check.detail and "2.13.0" in check.detail
    assert report.exit_code == 1
    assert json.loads(report.to_json())["exit_code"] == 1


def test_torch_below_floor_and_mixed_cuda_runtimes(tmp_path):
    site = tmp_path / "site"
    make_dist(site, "torch", "2.4.1", top_level="torch")
    make_dist(site, "nvidia-cublas-cu12", "12.8.4.1")
    make_dist(site, "nvidia-cuda-runtime", "13.0.96")
    report = run_doctor(paths=[str(site)])  # only the fabricated env
    assert _check(report, "torch").status == "fail" and "2.4.1 < 2.11" in _check(report, "torch").detail
    cuda = _check(report, "cuda runtimes")
    assert cuda.status == "warn" and "CUDA 12" in cuda.detail and "CUDA 13" in cuda.detail
    assert _check(report, "pinned dependencies").status == "warn"  # transformers etc. are missing there


def test_credentials_are_booleans_and_secrets_never_appear(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "supersecret-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "supersecret")
    monkeypatch.setenv("WANDB_API_KEY", "supersecret-wandb")
    report = run_doctor(RunConfig(run_dir=str(tmp_path / "run")))
    assert _check(report, "credentials").detail == "s3: present, wandb: present"
    assert "supersecret" not in report.to_json() and "supersecret" not in format_report(report)


def test_missing_credentials_warn_only_when_the_config_needs_them(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    plain = RunConfig(run_dir=str(tmp_path / "run"))
    assert _check(run_doctor(plain), "credentials").status == "ok"
    remote = RunConfig(run_dir=str(tmp_path / "run"), checkpoint={"remote": "s3://bucket/run"})
    assert _check(run_doctor(remote), "credentials").status == "warn"
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text("[default]\naws_access_key_id = x\n")
    assert _check(run_doctor(remote), "credentials").status == "ok"


def test_kernel_tuning_left_on_is_a_warning_naming_it(tmp_path):
    import torch._inductor.config as inductor_config

    with inductor_config.patch(coordinate_descent_tuning=True, max_autotune=True):
        report = run_doctor(RunConfig(run_dir=str(tmp_path / "run")))
    check = _check(report, "kernel tuning")
    assert check.status == "warn" and check.detail.startswith("coordinate_descent_tuning, max_autotune on:")
    assert report.exit_code == 0
