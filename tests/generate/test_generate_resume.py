"""kill -9 at any moment, rerun the same command: every input row exactly once in the output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from dflash_train.generate.job import generate
from dflash_train.generate.config import (
    build_generate_config,
    load_generate_config,
)
from tests.generate.conftest import REPO, conversation, read_rows, write_jsonl

NUM_ROWS = 240


def start_generate(config_path) -> subprocess.Popen:
    code = (
        "import sys; from dflash_train.generate.job import generate; "
        "from dflash_train.generate.config import load_generate_config; "
        "generate(load_generate_config(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code, str(config_path)], env=env, stderr=subprocess.PIPE)


def kill_after_shards(proc: subprocess.Popen, out_dir, num_shards: int) -> None:
    deadline = time.monotonic() + 30
    while len(list(out_dir.glob("shard-*.parquet"))) < num_shards:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "no shards committed"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_kill_9_midway_then_rerun_loses_and_duplicates_nothing(tmp_path, start_server):
    slow = start_server("--echo", "--stall-every", "1", "--stall-s", "0.02")  # ~400 requests/s at 8 in flight
    inputs = write_jsonl(tmp_path / "in.jsonl", [conversation(i, turns=2) for i in range(NUM_ROWS)])
    out_dir = tmp_path / "out"
    config = tmp_path / "gen.yaml"
    settings = {"inputs": [str(inputs)], "output_dir": str(out_dir), "concurrency": 8, "shard_size": 7,
                "progress": False, "http": {"server_urls": [slow.url]}}
    config.write_text(yaml.safe_dump(settings))

    for num_shards in (3, 9):  # killed twice, at different points
        kill_after_shards(start_generate(config), out_dir, num_shards)
    committed = read_rows(out_dir)
    assert 0 < len(committed) < NUM_ROWS
    (out_dir / ".shard-000077.parquet.x1y2.tmp").write_bytes(b"PAR1 half a shard")  # as a kill mid-write leaves

    summary = generate(load_generate_config(config))
    rows = read_rows(out_dir)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == NUM_ROWS
    assert set(ids) == {f"c{i}" for i in range(NUM_ROWS)}
    assert all(r["status"] == "ok" and r["num_turns"] == 2 for r in rows)
    assert (summary["rows_in"], summary["rows_out"], summary["ok"]) == (NUM_ROWS, NUM_ROWS, NUM_ROWS)
    assert summary["this_run"]["already_done"] == len(committed)
    assert summary["this_run"]["rows"] == NUM_ROWS - len(committed)
    assert summary["rows_not_in_inputs"] == 0
    assert not list(out_dir.glob(".*.tmp"))

    again = generate(load_generate_config(config))  # finished: a rerun does nothing
    assert again["this_run"]["rows"] == 0 and again["rows_out"] == NUM_ROWS


def test_resume_refuses_other_sampling_settings(tmp_path, start_server):
    server = start_server("--echo")
    inputs = write_jsonl(tmp_path / "in.jsonl", [conversation(i) for i in range(3)])

    def config(**sampling):
        return build_generate_config(
            {"inputs": [str(inputs)], "output_dir": str(tmp_path / "out"), "progress": False, "sampling": sampling},
            {"http.server_urls": [server.url]},
        )

    generate(config(temperature=0.0))
    with pytest.raises(ValueError, match="other settings"):
        generate(config(temperature=0.7))
