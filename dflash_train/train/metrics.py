"""metrics.jsonl: one JSON object per logged step, appended and flushed (always on)."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_train.atomic import write_atomic


class MetricsFile:
    def __init__(self, run_dir: str | Path, resume_step: int = 0):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # step 0 too: a run that crashed before its first checkpoint starts over
            self._truncate_after(resume_step)
        self._f = self.path.open("a")

    def _truncate_after(self, step: int) -> None:
        """A (re)started run rewrites the steps after its checkpoint (all of them from step 0): drop
        the old lines for them, so no step is recorded twice."""
        kept = [
            line for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        text = "".join(line + "\n" for line in kept)
        write_atomic(self.path, lambda f: f.write(text.encode()))

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
