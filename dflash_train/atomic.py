"""Crash-safe writes: a reader sees the old file (or directory) or the new one, never half of one.

Everything is written beside its destination (os.replace is atomic within one filesystem),
fsynced, renamed, and the parent directory fsynced so the rename itself survives a power cut.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

from dflash_train.disk import writes_to


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _umask() -> int:
    """Read once: Python can only read the umask by setting it, which other threads could see."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode(directory: bool = False) -> int:
    """The mode a plain open() or mkdir() gives under the process's umask. Temp files and folders
    are created owner-only; what they become is given this mode, so a server running as another
    user (a converted target, an export) can read it as it could any file the user writes."""
    return (0o777 if directory else 0o666) & ~_umask()


def write_atomic(path: str | Path, write) -> Path:
    """`write(binary file)` into a temp sibling, fsync, rename over `path`. A full disk or a
    read-only one is a DiskError naming `path`, and no temp file is left."""
    path = Path(path)
    with writes_to(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, default_mode())
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
    return path


def write_json_atomic(path: str | Path, obj: object) -> Path:
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    return write_atomic(path, lambda f: f.write(text.encode()))


def read_json(path: str | Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing or unreadable."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def swap_dir(tmp: str | Path, final: str | Path) -> Path:
    """Fsync every file of the finished directory `tmp`, then put it at `final` (replacing any old one),
    its files readable as any file the user writes (`default_mode`)."""
    tmp, final = Path(tmp), Path(final)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fchmod(fh.fileno(), default_mode())  # safetensors and mkstemp write owner-only files
            os.fsync(fh.fileno())
    fsync_dir(tmp)
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    return final


def new_temp_dir(final: str | Path) -> Path:
    """An empty hidden directory beside `final`, to be filled and then `swap_dir`-ed into place."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    tmp.chmod(default_mode(directory=True))
    return tmp
