"""Faults of the disk said in one line: where a command writes is checked before its expensive work,
and a write that fails for want of space or permission later names its path.

Without this a read-only mount ended `train` in an OSError traceback after the target had loaded,
and a full disk in one from whichever writer hit it first; an OSError raised by `write()` names
no file at all.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path

from dflash_train.errors import UserError

REASONS = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
}
"""The errors that the user fixes on the machine (a mount, a permission, space), never in the code."""


class DiskError(UserError):
    """A location cannot be written: read-only, no permission, out of space."""


_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How a Rust library (safetensors) words an I/O error: it arrives as its own exception type."""


def as_disk_error(err: BaseException, path: str | Path | None = None) -> DiskError | None:
    """`err` as one line naming its file (else `path`), when it is a disk fault; None otherwise.
    The fault may be the cause or context of another error (torch.save raises a RuntimeError over
    the OSError of its file), or only in its text (safetensors)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        code = err.errno if isinstance(err, OSError) else None
        if code is None and (m := _OS_ERROR.search(str(err))):
            code = int(m.group(1))
        if code in REASONS:
            where = (err.filename if isinstance(err, OSError) else None) or path or "a file"
            return DiskError(f"{where}: {REASONS[code]}")
        err = err.__cause__ or err.__context__
    return None


@contextmanager
def writes_to(path: str | Path):
    """Disk faults inside the block become a DiskError naming the file, or `path` where the error
    names none (a failed `write()` does not)."""
    try:
        yield
    except DiskError:
        raise
    except Exception as err:
        if (disk := as_disk_error(err, path)) is None:
            raise
        raise disk from err


def require_writable(path: str | Path, what: str) -> None:
    """Fail now, naming `path`, if `what` could not be written there. A missing directory is not
    created: its nearest existing parent is probed instead, as creating it would need."""
    path = Path(path).expanduser().absolute()
    probed = next(p for p in (path, *path.parents) if p.exists())
    try:
        if not probed.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(probed))
        # A small write, fsynced: a full disk refuses it, and a read-only mount refuses the create.
        fd, probe = tempfile.mkstemp(dir=probed, prefix=".dflash-write-check-")
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as err:
        reason = REASONS.get(err.errno, err.strerror or type(err).__name__)
        where = "" if probed == path else f" (it would be created in {probed})"
        raise DiskError(f"{path}: cannot write {what}: {reason}{where}") from err
