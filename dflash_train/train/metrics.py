"""metrics.jsonl: one JSON object per logged step, appended and flushed (always on)."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_train.atomic import write_atomic
from dflash_train.disk import writes_to


class MetricsFile:
    def __init__(self, run_dir: str | Path, resume_step: int = 0):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # step 0 too: a run that crashed before its first checkpoint starts over
            self._truncate_after(resume_step)
        # Unbuffered: a write that fails (a full disk) leaves nothing behind for a later flush to fail on.
        self._f = self.path.open("ab", buffering=0)

    def _truncate_after(self, step: int) -> None:
        """A (re)started run rewrites the steps after its checkpoint (all of them from step 0): drop
        the old lines for them, so no step is recorded twice."""
        kept = [line for line in self.path.read_text().splitlines()
                if (record := _record(line)) is not None and record.get("step", 0) <= step]
        text = "".join(line + "\n" for line in kept)
        write_atomic(self.path, lambda f: f.write(text.encode()))

    def write(self, record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        with writes_to(self.path):  # a full disk fails in write(), whose error names no file
            while data:  # a nearly full disk may take part of the line first
                data = data[self._f.write(data):]

    def close(self) -> None:
        self._f.close()


def _record(line: str) -> dict | None:
    """The record on one line; None for a blank line or one cut short by a crash or a full disk."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The run's records. A last line without its newline is not one yet: a running trainer may be
    writing it as this reads (or a crash cut it short, which the resumed run drops)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    complete = path.read_text().split("\n")[:-1]
    return [json.loads(line) for line in complete if line.strip()]
