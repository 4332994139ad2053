"""Helpers of the distributed CPU/gloo tests: tiny run assets and configs, forked workers, torchrun."""

import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from dflash_train.config import load_config
from dflash_train.distributed.run import drafter_runs, main
from dflash_train.train.loop import Trainer
from dflash_train.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]


def write_assets(root: Path, target) -> Path:
    """`root/target` (the saved tiny target) and `root/data.jsonl` (24 random-word conversations)."""
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
        "draft": {"num_layers": 1, "attention": "sdpa"},
        "objective": {"block_size": 4, "num_anchors": 8, "gamma": 4.0},
        "data": {"train_files": [str(assets / "data.jsonl")], "max_length": 96, "token_budget": 192,
                 "max_batch_size": 2},
        "train": {"lr": 1e-3, "warmup_ratio": 0.0, "grad_accum": 4, "max_steps": 4, "log_every": 1},
        "checkpoint": {"every": 2, "keep_last": 5},
        **extra,
    }
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def reference_losses(config: Path, run_dir: Path, overrides: list[str] = ()) -> list[float]:
    for _, cfg in drafter_runs(load_config(config, [f"run_dir={run_dir}", *overrides])):
        Trainer(cfg).fit(progress=False)
    return [r["loss"] for r in read_metrics(run_dir)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    os._exit(main(argv))


def fork_all(calls: list[tuple], timeout: float = 120) -> list[int]:
    """Runs each (function, args) in a forked process (fast: torch is already imported); exit codes."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=fn, args=args) for fn, args in calls]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    return [p.exitcode for p in procs]


def spawn(world: int, argv: list[str], timeout: float = 120) -> list[int]:
    """The distributed worker (`main(argv)`) on `world` forked ranks."""
    port = free_port()
    return fork_all([(_worker, (r, world, port, argv)) for r in range(world)], timeout)


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]




def children(pid: int) -> dict[int, int]:
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


def dist_env() -> dict:
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")


def launch_node(node_rank: int, endpoint: str, argv: list[str]) -> subprocess.Popen:
    """One machine of a two-node `dflash-train launch` (one process per node), in its own session."""
    cmd = [sys.executable, "-m", "dflash_train", "launch", "--nproc-per-node", "1", "--nnodes", "2",
           "--node-rank", str(node_rank), "--rdzv-endpoint", endpoint, *argv]
    return subprocess.Popen(cmd, env=dist_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def torchrun(nproc: int, argv: list[str]) -> subprocess.Popen:
    env = dist_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--monitor-interval", "0.5", "-m", "dflash_train.distributed.run", *argv]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
