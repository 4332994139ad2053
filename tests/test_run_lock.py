"""One writer per run: a second `train` (or capture, generate) into the same output is refused in
one line naming the first; a holder killed with SIGKILL leaves no stale lock."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflash_train.generate.config import build_generate_config
from dflash_train.generate.job import generate
from dflash_train.run_lock import RunLock, RunLocked
from dflash_train.train.metrics import read_metrics
from dist_runs import reference_losses, write_assets, write_config
from tiny import tiny_target

HOLD = """
import sys, time
from dflash_train.run_lock import RunLock
RunLock(sys.argv[1], "train").__enter__()
print("held", flush=True)
time.sleep(600)
"""


def hold_in_another_process(directory: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_second_writer_is_refused_naming_the_holder_until_it_is_killed(tmp_path):
    holder = hold_in_another_process(tmp_path / "run")
    try:
        with pytest.raises(RunLocked, match=rf"run is in use by `train` \(pid {holder.pid} on "
                                            rf"{socket.gethostname()}, since .* UTC\)"):
            RunLock(tmp_path / "run", "train").__enter__()
        config = build_generate_config({"inputs": [str(tmp_path / "in.jsonl")], "output_dir": str(tmp_path / "run"),
                                        "progress": False}, {"http.server_urls": ["http://127.0.0.1:9"]})
        with pytest.raises(RunLocked, match=f"pid {holder.pid}"):  # before it reads an input or calls a server
            generate(config)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunLock(tmp_path / "run", "capture"), RunLock(tmp_path / "run", "train"):  # no stale lock; re-entrant
        assert json.loads((tmp_path / "run" / ".lock").read_text())["command"] == "capture"
    with RunLock(tmp_path / "run", "train"):  # released with its last holder in this process
        pass


@pytest.mark.slow(seconds=40)
def test_two_train_processes_on_one_run_dir(tmp_path):
    """The second exits at once in one line naming the first; the first trains on undisturbed."""
    assets = write_assets(tmp_path / "assets", tiny_target(num_layers=3, hidden=32))
    config = write_config(assets, tmp_path / "run", train={"lr": 1e-3, "warmup_ratio": 0.0, "grad_accum": 2,
                                                           "max_steps": 40, "log_every": 1})
    train = [sys.executable, "-m", "dflash_train", "train", "-c", str(config)]
    first = subprocess.Popen(train, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = tmp_path / "run" / ".lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    second = subprocess.run(train, capture_output=True, text=True, timeout=60)
    assert first.poll() is None, "the first run ended before the second started: make it longer"
    assert second.returncode == 2
    assert second.stderr.count("\n") == 1 and f"is in use by `train` (pid {first.pid} on" in second.stderr
    first.communicate(timeout=120)
    assert first.returncode == 0
    expected = reference_losses(config, tmp_path / "ref")
    assert [r["loss"] for r in read_metrics(tmp_path / "run")] == pytest.approx(expected, abs=1e-6)
    assert len(expected) == 40


def test_launch_holds_the_run_dir_for_its_ranks(tmp_path, monkeypatch):
    """`launch` locks each drafter's run dir in the process torchrun becomes and tells the ranks."""
    from dflash_train.distributed import launch

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "target": {"path": "smollm2"}}))
    execs = []
    monkeypatch.setattr(launch.os, "execvp", lambda *cmd: execs.append(cmd))
    monkeypatch.setattr(launch, "check_memory", lambda *a, **k: None)
    monkeypatch.setenv("DFLASH_TRAIN_HELD_LOCKS", "")
    launch.main(["-c", str(config), "--colocated", "--nproc-per-node", "2"])
    assert execs and os.environ["DFLASH_TRAIN_HELD_LOCKS"] == str((tmp_path / "run").resolve())
    holder = json.loads((tmp_path / "run" / ".lock").read_text())
    assert holder["command"] == "launch" and holder["pid"] == os.getpid()
    monkeypatch.delenv("DFLASH_TRAIN_HELD_LOCKS")
    probe = subprocess.run([sys.executable, "-c", HOLD, str(tmp_path / "run")], capture_output=True, text=True,
                           timeout=60)
    assert probe.returncode == 1 and f"in use by `launch` (pid {os.getpid()}" in probe.stderr
