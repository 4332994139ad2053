"""Finding llama.cpp: a named tree, PATH, the cached pinned build; one line when none is usable."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from dflash_train.serve import llama_cpp
from dflash_train.serve.llama_cpp import LlamaCppError, find_llama_cpp


def fake_tree(root: Path, help_text: str) -> Path:
    """A llama.cpp-shaped tree whose llama-server prints `help_text` for --help."""
    (root / "build" / "bin").mkdir(parents=True)
    (root / "convert_hf_to_gguf.py").write_text("")
    server = root / "build" / "bin" / "llama-server"
    server.write_text(f"#!/bin/sh\necho '{help_text}'\n")
    server.chmod(server.stat().st_mode | stat.S_IXUSR)
    return root


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv(llama_cpp.ENV, raising=False)


def test_a_named_tree_that_serves_dflash_is_used(tmp_path):
    tree = fake_tree(tmp_path / "llama.cpp", "--spec-type [none|draft-dflash|draft-dspark]")
    found = find_llama_cpp(str(tree))
    assert found.server == tree / "build" / "bin" / "llama-server"
    assert found.converter == tree / "convert_hf_to_gguf.py"


def test_a_server_without_dflash_is_too_old_in_one_line(tmp_path):
    tree = fake_tree(tmp_path / "old", "--spec-type [none|draft-simple]")
    with pytest.raises(LlamaCppError, match="too old") as err:
        find_llama_cpp(str(tree))
    assert "\n" not in str(err.value) and "--build-llama-cpp" in str(err.value)


def test_a_tree_without_the_converter_is_refused(tmp_path):
    tree = fake_tree(tmp_path / "t", "draft-dflash")
    (tree / "convert_hf_to_gguf.py").unlink()
    with pytest.raises(LlamaCppError, match="convert_hf_to_gguf.py"):
        find_llama_cpp(str(tree))


def test_the_environment_names_a_tree(tmp_path, monkeypatch):
    tree = fake_tree(tmp_path / "env", "draft-dflash")
    monkeypatch.setenv(llama_cpp.ENV, str(tree))
    assert find_llama_cpp().source == tree


def test_a_server_on_path_inside_a_source_tree_is_found(tmp_path, monkeypatch):
    tree = fake_tree(tmp_path / "src", "draft-dflash")
    monkeypatch.setenv("PATH", f"{tree / 'build' / 'bin'}:/usr/bin:/bin")
    assert find_llama_cpp().source == tree.resolve()


def test_the_cached_pinned_build_is_found(tmp_path):
    fake_tree(llama_cpp.pinned_dir(), "draft-dflash")
    assert find_llama_cpp().source == llama_cpp.pinned_dir()


def test_nothing_found_says_how_to_get_it_without_building(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp, "build_pinned", lambda: pytest.fail("built without --build-llama-cpp"))
    with pytest.raises(LlamaCppError, match="no llama.cpp found") as err:
        find_llama_cpp()
    assert "--llama-cpp DIR" in str(err.value) and "11434.0.0" in str(err.value)
