"""Finished rows are committed on a clock, not only when the next row finishes: a job killed (kill -9)
again and again keeps making progress, and its output ends with every input row exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import dflash_train.generate.job as job
from dflash_train.generate.backends import Completion
from dflash_train.generate.config import build_generate_config
from dflash_train.generate.job import generate
from tests.generate.conftest import conversation, read_rows, write_jsonl


class SlowBackend:
    """Answers each conversation after `seconds`; `first_only`: the rest never finish."""

    def __init__(self, seconds: float, first_only: bool = False):
        self.seconds, self.first_only, self.answered = seconds, first_only, 0

    async def identity(self) -> dict:
        return {"model": "slow-echo"}

    async def complete(self, messages, params) -> Completion:
        if self.first_only and self.answered:
            await asyncio.Event().wait()
        self.answered += 1
        await asyncio.sleep(self.seconds)
        return Completion(text=f"re: {messages[-1]['content']}", prompt_tokens=1, completion_tokens=1,
                          finish_reason="stop")

    async def aclose(self) -> None:
        pass


def _config(tmp_path, rows: int, interval_s: float):
    inputs = write_jsonl(tmp_path / "in.jsonl", [conversation(i) for i in range(rows)])
    return build_generate_config({"inputs": [str(inputs)], "output_dir": str(tmp_path / "out"), "progress": False,
                                  "shard_interval_s": interval_s, "concurrency": 2},
                                 {"http.server_urls": ["http://127.0.0.1:9"]})


def test_a_finished_row_is_committed_while_no_other_finishes(tmp_path, monkeypatch):
    monkeypatch.setattr(job, "make_backend", lambda cfg: SlowBackend(0.01, first_only=True))
    cfg = _config(tmp_path, rows=3, interval_s=0.1)

    async def run_until_committed() -> list[dict]:
        task = asyncio.create_task(job._generate(cfg))
        deadline = time.monotonic() + 5
        while not (rows := read_rows(tmp_path / "out")):
            assert not task.done() and time.monotonic() < deadline, "nothing committed on time"
            await asyncio.sleep(0.02)
        assert not task.done()  # committed by the clock, not at the end of the run
        task.cancel()
        return rows

    assert [r["id"] for r in asyncio.run(run_until_committed())] == ["c0"]


def test_a_job_killed_every_few_commit_intervals_finishes_every_row_once(tmp_path, monkeypatch):
    monkeypatch.setattr(job, "make_backend", lambda cfg: SlowBackend(0.05))
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # the cadence is tested here, not a busy disk's fsyncs
    rows = 12  # 0.3 s of answers at 2 in flight; each process lives 0.2 s, 4 commit intervals
    cfg = _config(tmp_path, rows=rows, interval_s=0.05)
    committed, kills = [0], 0
    while not (tmp_path / "out" / "summary.json").exists():
        assert kills < 12, f"no progress: committed rows after each kill {committed}"
        pid = os.fork()
        if pid == 0:  # the child: a plain run, ended only by SIGKILL (no cleanup) or by finishing
            try:
                generate(cfg)
            finally:
                os._exit(0)
        time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        kills += 1
        committed.append(len(read_rows(tmp_path / "out")))
    assert kills >= 2, committed  # resumed across kills, not finished at the first try
    assert committed == sorted(committed)
    ids = [r["id"] for r in read_rows(tmp_path / "out")]
    assert sorted(ids) == sorted(f"c{i}" for i in range(rows))  # every row, exactly once


def test_sigterm_commits_the_finished_rows_and_the_same_command_finishes_every_row_once(tmp_path, start_server):
    """A scheduler's SIGTERM through the real command: the rows finished are committed, one line says
    how to go on (exit 75), and the same command then writes the others, every row exactly once."""
    import subprocess
    import sys

    from tests.generate.conftest import REPO

    server = start_server("--echo", "--stall-every", "1", "--stall-s", "0.1")
    inputs = write_jsonl(tmp_path / "in.jsonl", [conversation(i) for i in range(60)])
    argv = [sys.executable, "-m", "dflash_train", "generate", "--input", str(inputs), "--out", str(tmp_path / "out"),
            "--no-progress", "--commit-interval", "1000", "concurrency=2", f"http.server_urls=[{server.url}]"]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while server.stats()["requests"] < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    kept = read_rows(tmp_path / "out")  # nothing was due on the clock: committed by the stop
    assert 4 <= len(kept) < 60 and "Traceback" not in err
    assert f"generate stopped: {tmp_path / 'out'} keeps {len(kept)} committed rows" in err
    assert err.splitlines()[-1] == "SIGTERM: generate stopped; the rows committed are kept; the same command resumes after them"
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    ids = [r["id"] for r in read_rows(tmp_path / "out")]
    assert sorted(ids) == sorted(f"c{i}" for i in range(60)) and len(ids) == len(set(ids))
