"""A checkpoint's own integrity record: every file's size and sha256, checked before it is trusted.

Atomic writes keep a crash from leaving half a checkpoint under a complete name; they do nothing
for a file damaged afterwards (a copy cut short by a full disk, a bit flipped at rest). The record,
`integrity.json`, is written last into the checkpoint's temp dir, so it is inside the atomic rename:
a checkpoint under its final name without one was written before records existed (it is used,
with a warning), and one whose record does not parse was damaged after it was complete.
Hashing runs where the files are written, in the background writer thread; checking reads every
file once (an 8B target's 11.7 GiB checkpoint: tens of seconds, once per resume).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_train.errors import UserError

RECORD = "integrity.json"
FORMAT = "dflash-checkpoint-integrity/1"
_MiB = 1024 * 1024


class CheckpointError(UserError):
    """A checkpoint that cannot be used: unreadable, or not what its integrity record says."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * _MiB):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    name: str
    """Path relative to the checkpoint directory, '/'-separated."""
    size: int
    sha256: str


def hash_checkpoint(local_dir: Path) -> list[FileEntry]:
    files = sorted(p for p in local_dir.rglob("*") if p.is_file())
    return [FileEntry(p.relative_to(local_dir).as_posix(), p.stat().st_size, sha256_file(p)) for p in files]


def write_record(ckpt_dir: Path) -> None:
    """Record every file of the finished (not yet renamed) checkpoint dir; call it last."""
    entries = [asdict(e) for e in hash_checkpoint(ckpt_dir) if e.name != RECORD]
    with open(ckpt_dir / RECORD, "w") as f:
        json.dump({"format": FORMAT, "files": entries}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def has_record(ckpt_dir: Path) -> bool:
    return (Path(ckpt_dir) / RECORD).is_file()


def find_fault(ckpt_dir: Path, names: list[str] | None = None) -> str | None:
    """Why the checkpoint is not what its record says, e.g. 'model.safetensors: 1,024 bytes, its
    integrity record says 2,048'; None when every recorded file (or each of `names`) matches."""
    ckpt_dir = Path(ckpt_dir)
    try:
        record = json.loads((ckpt_dir / RECORD).read_text())
        entries = {e["name"]: FileEntry(**e) for e in record["files"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{RECORD}: unreadable ({type(err).__name__}: {str(err)[:120]})"
    for name in names or sorted(entries):
        entry, path = entries.get(name), ckpt_dir / name
        if entry is None:
            return f"{name}: not in its integrity record"
        if not path.is_file():
            return f"{name}: missing"
        if (size := path.stat().st_size) != entry.size:
            return f"{name}: {size:,} bytes, its integrity record says {entry.size:,}"
        if sha256_file(path) != entry.sha256:
            return f"{name}: contents differ from its integrity record (sha256)"
    return None


def require_intact(ckpt_dir: Path, names: list[str] | None = None) -> bool:
    """Raise a one-line CheckpointError naming the file when the checkpoint (or `names` of its
    files) differs from its record. False when it has no record (written before records existed)."""
    if not has_record(ckpt_dir):
        return False
    if (fault := find_fault(ckpt_dir, names)) is not None:
        raise CheckpointError(f"{ckpt_dir}: corrupt checkpoint: {fault}")
    return True
