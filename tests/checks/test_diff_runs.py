import copy

import pytest

from dflash_train.config import RunConfig
from dflash_train.checks.diff_runs import ABSENT, diff_manifests, diff_runs
from dflash_train.checks.manifest import build_manifest, write_manifest


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    return build_manifest(RunConfig().model_dump(mode="json"), ["dflash-train", "train"], run_dir)


def test_lists_exactly_the_changes_relevant_first(manifest):
    other = copy.deepcopy(manifest)
    other["packages"]["torch"] = "2.11.0+cu130"
    other["config"]["train"]["lr"] = 1e-4
    other["hostname"] = "elsewhere"
    other["compile_settings"]["inductor"]["coordinate_descent_tuning"] = True
    diffs = diff_manifests(manifest, other)
    assert diffs == [
        ("packages.torch", manifest["packages"]["torch"], "2.11.0+cu130"),
        ("compile_settings.inductor.coordinate_descent_tuning", ABSENT, True),
        ("config.train.lr", 6e-4, 1e-4),
        ("hostname", manifest["hostname"], "elsewhere"),
    ]


def test_missing_keys_and_identical_manifests(manifest):
    assert diff_manifests(manifest, copy.deepcopy(manifest)) == []
    other = copy.deepcopy(manifest)
    other["packages"]["vllm"] = "0.11.0"
    assert diff_manifests(manifest, other) == [("packages.vllm", ABSENT, "0.11.0")]


def test_diff_runs_reads_run_dirs(tmp_path, manifest):
    other = copy.deepcopy(manifest)
    other["packages"]["torch"] = "2.11.0+cu130"
    write_manifest(tmp_path / "a", manifest)
    write_manifest(tmp_path / "b", other)
    table = diff_runs(tmp_path / "a", tmp_path / "b")
    lines = table.splitlines()
    assert lines[0].split() == ["key", str(tmp_path / "a"), str(tmp_path / "b")]
    assert lines[2].split() == ["packages.torch", manifest["packages"]["torch"], "2.11.0+cu130"]
    assert len(lines) == 3
    with pytest.raises(ValueError, match="manifest.json"):
        diff_runs(tmp_path / "a", tmp_path / "missing")
