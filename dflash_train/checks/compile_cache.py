"""A persistent compile cache, keyed by everything that invalidates compiled kernels.

The run that motivated this lost its inductor/triton caches when /tmp was cleaned and paid full
compilation again without anyone noticing. Here every (torch, triton, CUDA, GPU arch, drafter
source) combination gets its own directory under a durable root, a completed warm-up leaves a
marker, and the trainer/doctor can say whether a run starts cold, warm or against a stale cache.
Other keys are never deleted: switching back to an earlier environment must stay warm.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

import torch

from dflash_train.atomic import read_json, write_json_atomic

MARKER = "WARM.json"
_VOLATILE_ROOTS = (Path("/tmp"), Path("/var/tmp"))


def cache_root(root: str | Path | None = None) -> Path:
    """`root` if given (a config value), else $DFLASH_TRAIN_CACHE/compile, else
    ~/.cache/dflash-train/compile."""
    if root is not None:
        return Path(root).expanduser()
    base = os.environ.get("DFLASH_TRAIN_CACHE")
    base_path = Path(base).expanduser() if base else Path.home() / ".cache" / "dflash-train"
    return base_path / "compile"


def default_code_paths() -> list[Path]:
    """The drafter sources that torch.compile traces; an edit there invalidates kernels."""
    draft_dir = Path(__file__).resolve().parent.parent / "draft"
    return sorted(draft_dir.glob("*.py"))


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def _gpu_arch() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def cache_key(code_paths: list[Path] | None = None) -> str:
    """A readable prefix (torch/CUDA/arch) plus a digest over versions and compiled source."""
    paths = default_code_paths() if code_paths is None else sorted(Path(p) for p in code_paths)
    cuda = torch.version.cuda or "cpu"
    parts = [torch.__version__, _triton_version(), cuda, _gpu_arch()]
    digest = hashlib.sha256("\0".join(parts).encode())
    for path in paths:
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    hw_tag = f"cu{cuda}-{_gpu_arch()}" if torch.version.cuda else "cpu"
    prefix = re.sub(r"[^A-Za-z0-9._-]", "_", f"torch{torch.__version__}-{hw_tag}")
    return f"{prefix}-{digest.hexdigest()[:16]}"


def _is_volatile(path: Path) -> bool:
    resolved = path.resolve()
    return any(resolved.is_relative_to(v.resolve()) for v in _VOLATILE_ROOTS)


CACHE_SWITCHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
"""The variables `activate` sets besides the two folders: inductor's caches on."""


def activate(key: str, root: str | Path | None = None, *, allow_tmp: bool = False) -> Path:
    """Point inductor and triton at `<root>/<key>`. Call before the first torch.compile.

    Inductor and triton read these variables when they first touch their caches, so setting them
    after compiling has started would silently keep the old (possibly volatile) location.
    """
    root = cache_root(root)
    if _is_volatile(root) and not allow_tmp:
        raise ValueError(
            f"compile cache root {root} is under /tmp or /var/tmp, which get cleaned: every run "
            "would recompile from scratch. Choose a durable directory (or pass allow_tmp=True)."
        )
    key_dir = root / key
    (key_dir / "inductor").mkdir(parents=True, exist_ok=True)
    (key_dir / "triton").mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(key_dir / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(key_dir / "triton")
    os.environ.update(CACHE_SWITCHES)
    return key_dir


def _keys(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def cache_state(key: str, root: str | Path | None = None) -> str:
    """warm: this key finished a warm-up; stale: only other keys did or exist; cold: nothing."""
    root = cache_root(root)
    if (root / key / MARKER).is_file():
        return "warm"
    if any(k != key for k in _keys(root)):
        return "stale"
    return "cold"


def mark_warm(key: str, root: str | Path | None = None, info: dict | None = None) -> Path:
    """Record (atomically) that a warm-up under `key` completed; `info` is free-form context."""
    record = {"key": key, "marked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    record.update(info or {})
    return write_json_atomic(cache_root(root) / key / MARKER, record)


def _size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_caches(root: str | Path | None = None) -> list[dict]:
    """One entry per key: key, size_bytes, warm, and the marker's info (None when not warm)."""
    root = cache_root(root)
    entries = []
    for key in _keys(root):
        marker = root / key / MARKER
        entries.append(
            {
                "key": key,
                "size_bytes": _size_bytes(root / key),
                "warm": marker.is_file(),
                "info": read_json(marker),
            }
        )
    return entries
