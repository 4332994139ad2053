"""Crash-safe output: rows are committed in whole shards, atomically, and nothing else counts.

A shard is written to a temporary name, fsynced, renamed to `shard-NNNNNN.<ext>` and the
directory fsynced: after a `kill -9` or a power cut a shard is either complete or absent, never
half there. Resuming reads the `key` of every row in committed shards and skips those inputs;
leftover temporary files are deleted. The run lock (run_lock.py) keeps two runs from
writing the same rows twice.
The training reader (`formats.expand_paths`) takes the directory and reads its shards.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_train.atomic import write_atomic

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])
SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("id", pa.string()),
        ("source", pa.string()),
        ("status", pa.string()),
        ("reason", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("num_turns", pa.int32()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("num_truncated", pa.int32()),
    ]
)
STATUSES = ("ok", "error", "skipped")
_TMP_GLOB = ".*.tmp"  # what dflash_train.atomic.write_atomic leaves when killed mid-write



def remove_temp_files(out_dir: Path) -> int:
    """Delete what a killed run was writing; it was never committed. Call under the lock."""
    stale = list(out_dir.glob(_TMP_GLOB))
    for path in stale:
        path.unlink()
    return len(stale)


def committed_shards(out_dir: Path, fmt: str) -> list[Path]:
    return sorted(out_dir.glob(f"shard-*.{fmt}"))


def _read_columns(path: Path, columns: list[str]) -> dict[str, list]:
    if path.suffix == ".parquet":
        return pq.read_table(path, columns=columns).to_pydict()
    with path.open("rb") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {c: [r.get(c) for r in rows] for c in columns}


def read_done_keys(shards: list[Path]) -> set[str]:
    done: set[str] = set()
    for path in shards:
        done.update(_read_columns(path, ["key"])["key"])
    return done


def scan_outputs(shards: list[Path], top_reasons: int = 20) -> dict:
    """Row counts by status, token totals and the commonest error/skip reasons over all shards."""
    counts: Counter = Counter()
    reasons: Counter = Counter()
    totals = Counter()
    for path in shards:
        cols = _read_columns(path, ["status", "reason", "prompt_tokens", "completion_tokens", "num_truncated"])
        counts.update(cols["status"])
        reasons.update(f"{s}: {r}" for s, r in zip(cols["status"], cols["reason"]) if s != "ok")
        for name in ("prompt_tokens", "completion_tokens", "num_truncated"):
            totals[name] += sum(cols[name])
    return {
        "rows_out": sum(counts.values()),
        **{s: counts.get(s, 0) for s in STATUSES},
        "prompt_tokens": totals["prompt_tokens"],
        "completion_tokens": totals["completion_tokens"],
        "truncated_turns": totals["num_truncated"],
        "top_reasons": dict(reasons.most_common(top_reasons)),
        "shards": len(shards),
    }


def _write_parquet(rows: list[dict], f) -> None:
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    pq.write_table(table, f, compression="zstd")


def _write_jsonl(rows: list[dict], f) -> None:
    for row in rows:
        messages = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
        f.write(json.dumps({**row, "messages": messages}, ensure_ascii=False).encode() + b"\n")


class ShardWriter:
    """Buffers finished rows and commits them as a shard every `shard_size` rows or `interval_s`
    seconds, whichever comes first (`commit_on_time` keeps the clock when no row finishes). The
    clock starts with the writer: create it when the run starts, so that a slow start (a model
    load) counts towards the first commit."""

    def __init__(self, out_dir: Path, fmt: str, *, shard_size: int, interval_s: float):
        self.out_dir = out_dir
        self.fmt = fmt
        self.shard_size = shard_size
        self.interval_s = interval_s
        existing = committed_shards(out_dir, fmt)
        self.next_index = int(existing[-1].stem.split("-")[1]) + 1 if existing else 0
        self.buffer: list[dict] = []
        self.last_commit = time.monotonic()
        self.rows_committed = 0

    def add(self, row: dict) -> None:
        self.buffer.append(row)
        if len(self.buffer) >= self.shard_size or self._due():
            self.commit()

    def _due(self) -> bool:
        return bool(self.buffer) and time.monotonic() - self.last_commit >= self.interval_s

    async def commit_on_time(self) -> None:
        """Commit what is buffered once `interval_s` passed since the last commit, also while no
        other row finishes (a large batch of the local backend, long answers): a job killed at any
        moment loses at most the last `interval_s` of finished rows. Runs until cancelled."""
        while True:
            # Until the clock's deadline; past it with nothing waiting, `add` commits the next row at once.
            await asyncio.sleep(max(self.last_commit + self.interval_s - time.monotonic(), 0.0) or self.interval_s)
            if self._due():
                self.commit()

    def commit(self) -> Path | None:
        self.last_commit = time.monotonic()
        if not self.buffer:
            return None
        path = self.out_dir / f"shard-{self.next_index:06d}.{self.fmt}"
        rows, self.buffer = self.buffer, []
        write_atomic(path, lambda f: (_write_parquet if self.fmt == "parquet" else _write_jsonl)(rows, f))
        self.next_index += 1
        self.rows_committed += len(rows)
        return path
