"""One writer per output: a run directory (train, launch, capture) or a generation's output folder.

The first process that writes to an output holds an exclusive advisory lock on its `.lock` file for
as long as it runs; a second one is refused in one line naming the holder, before it loads anything.
The kernel drops the lock when its holder dies, however it dies: a crash never leaves a stale lock,
and `kill -9` of the holder frees the output for the next run. A process may take the same lock
again (quickstart's steps each lock what they write); it is released with the last holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from dflash_train.disk import require_writable
from dflash_train.errors import UserError

LOCK_FILE = ".lock"

HELD_ENV = "DFLASH_TRAIN_HELD_LOCKS"
"""Outputs the launching process holds for its workers (os.pathsep-separated): `launch` locks the
run dirs, then torchrun's ranks write to them without locking again."""

WRITES = {"train": "the run's checkpoints and metrics", "launch": "the run's checkpoints and metrics",
          "capture": "the captured features", "generate": "generate's output"}
"""What each command writes there, for the one line when it cannot."""

_held: dict[Path, list] = {}  # directory -> [fd, how many holders in this process]


class RunLocked(UserError):
    """Another process writes to this output."""


class RunLock:
    """`with RunLock(directory, "train"):` for the life of a run; raises RunLocked when taken."""

    def __init__(self, directory: str | Path, command: str):
        self.directory = Path(directory).resolve()
        self.command = command

    def __enter__(self) -> RunLock:
        if self.directory in _held:
            _held[self.directory][1] += 1
            return self
        if str(self.directory) in os.environ.get(HELD_ENV, "").split(os.pathsep):
            _held[self.directory] = [None, 1]
            return self
        require_writable(self.directory, WRITES.get(self.command, f"{self.command}'s output"))
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(path)
            os.close(fd)
            raise RunLocked(f"{self.directory} is in use by {holder}; a second writer would replace its files. "
                            "Wait for it to end, or choose another output") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"command": self.command, "pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}).encode())
        _held[self.directory] = [fd, 1]
        return self

    @property
    def descriptor(self) -> int | None:
        """The lock file's descriptor while held here (None when a launching process holds it)."""
        return _held[self.directory][0]

    def __exit__(self, *exc) -> None:
        entry = _held[self.directory]
        entry[1] -= 1
        if entry[1] == 0:
            del _held[self.directory]
            if entry[0] is not None:
                os.close(entry[0])  # closing releases the lock


def held_for_workers(directories: list[str | Path]) -> dict[str, str]:
    """The environment that lets a launching process's workers write to the outputs it locked."""
    return {HELD_ENV: os.pathsep.join(str(Path(d).resolve()) for d in directories)}


def _describe(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return f"`{info['command']}` (pid {info['pid']} on {info['host']}, since {info['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its lock file names none)"
