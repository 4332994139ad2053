"""GPU layouts side by side on one node, and a fault run, through `dflash-train launch`.

    python3 bench/dist_setup.py --out runs/dist --steps 40
    python3 bench/multi_gpu.py --setup runs/dist --out runs/multi_gpu \
        --variants one_gpu colocated 1t1d link
    python3 bench/multi_gpu.py --setup runs/dist --out runs/multi_gpu --variants auto fault

Each variant is a real training run of the same config (train.grad_accum = number of GPUs, so every
layout trains on the same global batches and its losses can be compared step by step). Recorded per
variant, as <out>/<variant>.json: the launch command, steady tokens/s (mean of the metrics' windows
after --warm steps), per-GPU utilisation and memory sampled through NVML during those windows,
the hidden-state stream it needed (tokens/s x bytes per token) and the per-step losses.
tokens/s counts training time only; checkpoint saves are logged apart (paused_s).
`link` measures the GPU-to-GPU bandwidth of one feature message (torchrun, NCCL send/recv).
`fault` kills the target rank after --kill-steps[0], resumes, kills the drafter rank after
--kill-steps[1], resumes to the end: records how long each launcher took to exit after the kill and
the final losses against the uninterrupted `1t1d` run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

LAUNCH = [sys.executable, "-m", "dflash_train", "launch"]
VARIANTS = {  # name: (launch arguments, number of GPUs, extra environment)
    "one_gpu": (["--colocated", "--nproc-per-node", "1"], 1, {"CUDA_VISIBLE_DEVICES": "0"}),
    "colocated": (["--colocated", "--nproc-per-node", "2"], 2, {}),
    "1t1d": (["--target-gpus", "1", "--nproc-per-node", "2"], 2, {}),
    "auto": (["--target-gpus", "auto", "--nproc-per-node", "2"], 2, {}),
}


class Monitor:
    """Samples every GPU's utilisation and memory (NVML) and the arrival time of each metrics line."""

    def __init__(self, metrics: Path, interval: float = 0.25):
        self.handles = []
        if torch.cuda.is_available():  # CPU runs (the gloo smoke test) record timings only
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.metrics, self.interval = metrics, interval
        self.samples: list[tuple[float, list[int], list[float]]] = []
        self.arrivals: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            util = [self.nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles]
            mem = [self.nvml.nvmlDeviceGetMemoryInfo(h).used / 2**30 for h in self.handles]
            self.samples.append((now, util, mem))
            for step in logged_steps(self.metrics):
                self.arrivals.setdefault(step, now)

    def window(self, start_step: int) -> dict:
        """Mean utilisation and peak memory per GPU from the arrival of `start_step` to the last line."""
        if start_step not in self.arrivals:
            return {}
        t0, t1 = self.arrivals[start_step], max(self.arrivals.values())
        inside = [(u, m) for t, u, m in self.samples if t0 <= t <= t1]
        if not inside:
            return {}
        gpus = range(len(self.handles))
        return {"seconds": round(t1 - t0, 1), "samples": len(inside),
                "util_pct": [round(sum(u[g] for u, _ in inside) / len(inside), 1) for g in gpus],
                "peak_mem_gib": [round(max(m[g] for _, m in inside), 1) for g in gpus]}


def logged_steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


def read_records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def feature_bytes_per_token(setup: Path, run_cfg: dict) -> int:
    from dflash_train.draft.model import default_target_layer_ids

    tc = json.loads((setup / "target" / "config.json").read_text())
    draft = run_cfg["draft"]
    ids = draft.get("target_layer_ids") or default_target_layer_ids(
        tc["num_hidden_layers"], draft.get("num_target_features") or draft["num_layers"])
    return len(ids) * tc["hidden_size"] * 2  # bf16


def launch(setup: Path, name: str, extra: list[str], env: dict, steps: int, args) -> subprocess.Popen:
    overrides = [f"run_dir={setup / 'runs' / name}", f"train.max_steps={steps}", f"train.grad_accum={args.grad_accum}",
                 f"train.log_every={args.log_every}", f"checkpoint.every={args.checkpoint_every}"]
    cmd = [*LAUNCH, "-c", str(setup / "run.yaml"), *extra, *overrides]
    print("+", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True)


def run_variant(setup: Path, name: str, args) -> dict:
    extra, gpus, env = VARIANTS[name]
    shutil.rmtree(setup / "runs" / name, ignore_errors=True)  # a fresh run, not appended to an old one
    metrics = setup / "runs" / name / "metrics.jsonl"
    t0 = time.monotonic()
    with Monitor(metrics) as monitor:
        proc = launch(setup, name, extra, env, args.steps, args)
        rc = proc.wait()
    records = read_records(metrics) if metrics.exists() else []
    steady = [r["tokens_per_s"] for r in records if r["step"] > args.warm]
    tps = sum(steady) / len(steady) if steady else None
    per_token = feature_bytes_per_token(setup, _yaml(setup / "run.yaml"))
    return {"variant": name, "returncode": rc, "gpus": gpus, "launch_args": extra, "wall_s": round(time.monotonic() - t0, 1),
            "steady_tokens_per_s": tps, "tokens_per_s_per_gpu": tps and tps / gpus,
            "feature_stream_gb_per_s": tps and tps * per_token / 1e9, "feature_bytes_per_token": per_token,
            "gpu_window": monitor.window(args.warm), "losses": {r["step"]: r["loss"] for r in records},
            "windows": [{k: r.get(k) for k in ("step", "tokens_per_s", "paused_s", "compiled_graphs",
                                                "recompiles_since_warmup")} for r in records]}


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def kill_rank_when(proc: subprocess.Popen, metrics: Path, step: int, rank: int, timeout: float) -> dict:
    """SIGKILL the worker with RANK=`rank` once this launch logged `step`; time the launcher's exit."""
    import psutil

    launched, deadline = time.time(), time.monotonic() + timeout
    # A resumed run rewrites the file first (steps up to its checkpoint): older lines do not count.
    while not (metrics.exists() and metrics.stat().st_mtime > launched
               and any(s >= step for s in logged_steps(metrics))):
        if proc.poll() is not None or time.monotonic() > deadline:
            return {"error": f"step {step} never logged (launcher rc {proc.poll()})"}
        time.sleep(0.05)
    agent = psutil.Process(proc.pid)  # `launch` execs torchrun: its direct children are the workers
    victim = next((p for p in agent.children() if p.environ().get("RANK") == str(rank)), None)
    if victim is None:
        return {"error": f"no worker with RANK={rank} (launcher rc {proc.poll()})"}
    descendants = agent.children(recursive=True)  # workers and their compile subprocesses
    victim.kill()
    t_kill = time.monotonic()
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = "hung > 120 s"
    survivors = [p.pid for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return {"killed_rank": rank, "at_logged_step": max(logged_steps(metrics)), "launcher_rc": rc,
            "exit_s_after_kill": round(time.monotonic() - t_kill, 1), "processes": len(descendants),
            "surviving_processes": survivors}


def fault_run(setup: Path, args) -> dict:
    extra, _, env = VARIANTS["1t1d"]
    shutil.rmtree(setup / "runs" / "fault", ignore_errors=True)
    metrics = setup / "runs" / "fault" / "metrics.jsonl"
    events = []
    for rank, step in zip((0, 1), args.kill_steps):
        resume = ["--resume", "auto"] if events else []
        proc = launch(setup, "fault", extra + resume, env, args.steps, args)
        events.append(kill_rank_when(proc, metrics, step, rank, timeout=400))
    t0 = time.monotonic()
    rc = launch(setup, "fault", extra + ["--resume", "auto"], env, args.steps, args).wait()
    losses = {r["step"]: r["loss"] for r in read_records(metrics)}
    reference = setup / "runs" / "1t1d" / "metrics.jsonl"
    ref = {r["step"]: r["loss"] for r in read_records(reference)} if reference.exists() else {}
    common = sorted(set(losses) & set(ref))
    return {"variant": "fault", "kills": events, "resume_returncode": rc, "resume_wall_s": round(time.monotonic() - t0, 1),
            "final_step": max(losses, default=None), "losses": losses,
            "max_abs_loss_diff_vs_1t1d": max((abs(losses[s] - ref[s]) for s in common), default=None),
            "compared_steps": common}


def link_worker(shape: list[int], repeats: int) -> None:
    """Rank 0 sends one feature message ([tokens, bytes-per-token/2] bf16) to rank 1, `repeats` times."""
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    buf = torch.ones(shape, dtype=torch.bfloat16, device="cuda")
    for i in range(repeats + 3):
        if i == 3:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if rank == 1:
        gbytes = buf.numel() * 2 * repeats / 1e9
        print(json.dumps({"message_mb": buf.numel() * 2 / 1e6, "repeats": repeats, "gb_per_s": gbytes / seconds}))
    dist.destroy_process_group()


def link_variant(setup: Path, args) -> dict:
    run_cfg = _yaml(setup / "run.yaml")
    per_token, tokens = feature_bytes_per_token(setup, run_cfg), run_cfg["data"]["max_length"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--link-worker", str(tokens), str(per_token // 2)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return {"variant": "link", "command": " ".join(cmd[1:]), "tokens": tokens, **result}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", help="the directory bench/dist_setup.py wrote")
    ap.add_argument("--out", help="directory for <variant>.json")
    ap.add_argument("--variants", nargs="+", default=["one_gpu", "colocated", "1t1d", "link"],
                    choices=[*VARIANTS, "link", "fault"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warm", type=int, default=10, help="steps left out of the steady window")
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--kill-steps", type=int, nargs=2, default=[15, 25])
    ap.add_argument("--link-worker", type=int, nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.link_worker:
        return link_worker(args.link_worker, repeats=20)
    setup, out = Path(args.setup), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.variants:
        if name == "link":
            result = link_variant(setup, args)
        elif name == "fault":
            result = fault_run(setup, args)
        else:
            result = run_variant(setup, name, args)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "windows")}), flush=True)


if __name__ == "__main__":
    main()
