"""The real training loop's speed with features from the target, from a capture, and from memory.

`bench/throughput.py` times one step in isolation; this runs the training loop itself (collation, anchor
sampling, masks, logging: everything a run does per step) on a run config, three times:
  target   the target runs every micro-batch (data.cache_features off)
  capture  features read from a `dflash-train capture` of the same data (first reads: disk to device)
  memory   the capture's features already in device memory (data.cache_features, filled before timing):
           the state of every epoch after the first
  cached   the same state with the cache filled by the target instead (no capture needed)
and times the capture itself. Steps/s and tokens/s are the median over the logged windows after the
first two (compile warm-up, the first buckets); the run's time budget is switched off and each arm
runs `--steps` steps.

    python bench/loop_speed.py -c configs/smollm2-h200.yaml [overrides] --work DIR --steps 300 --out X.json

On GPU the config's data and target are the real ones (the issue's figure: SmolLM2 at 32 anchors x
48 sequences: `objective.num_anchors=32 data.token_budget=...`); CI runs it on a tiny target.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_train.train.capture import MANIFEST, capture
from dflash_train.config import load_config
from dflash_train.targets.model import resolve_device
from dflash_train.train.build import build
from dflash_train.train.features import Features
from dflash_train.train.loop import train

SKIPPED_WINDOWS = 2
"""Logged windows left out of the medians: the compile warm-up and the first buckets' shapes."""

ARMS = {
    "target": ["data.cache_features=false"],
    "capture": ["data.cache_features=false", "data.captured_features={capture}"],
    "memory": ["data.cache_features=true", "data.captured_features={capture}"],
    "cached": ["data.cache_features=true"],
}
FILLED_BEFORE_TIMING = {"memory", "cached"}


def window_rates(metrics: Path) -> dict:
    """Median steps/s and tokens/s over a run's logged windows (each record: the window's real
    tokens and tokens/s), the first SKIPPED_WINDOWS left out."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r["step"] - before["step"] for before, r in zip([{"step": 0}, *records], records)]
    steady = list(zip(records, steps))[SKIPPED_WINDOWS:] or list(zip(records, steps))
    return {"steps_per_s": statistics.median(n * r["tokens_per_s"] / r["tokens"] for r, n in steady),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r, _ in steady),
            "tokens_per_step": statistics.mean(r["tokens"] / n for r, n in steady), "windows": len(steady)}


def fill_cache(features: Features, rows: int, rows_at_once: int = 1024) -> int:
    """Every row's captured features into device memory (as far as the cache's reserve allows)."""
    cache = features.cache
    for first in range(0, rows, rows_at_once):
        cache.fill(list(range(first, min(first + rows_at_once, rows))), features.make_rows)
        if cache.full:
            break
    return len(cache)


def run_arm(name: str, config: str, overrides: list[str], work: Path, steps: int) -> dict:
    arm = [o.format(capture=work / "capture") for o in ARMS[name]]
    cfg = load_config(config, [*overrides, *arm, f"run_dir={work / name}", f"train.max_steps={steps}",
                               "train.time_budget_minutes=null", "eval.heldout_files=[]", "eval.every=0",
                               f"checkpoint.every={10**9}"])
    gc.collect()  # the previous arm's run and cache: gone before this one measures memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    parts = build(cfg)
    extra = {}
    if name in FILLED_BEFORE_TIMING:  # the features in device memory before the clock starts
        t = time.perf_counter()
        cached = fill_cache(parts.features, len(parts.dataset))
        extra = {"cached_rows": cached, "rows": len(parts.dataset), "cache_fill_s": time.perf_counter() - t}
    reads = []
    captured = parts.features.captured
    if captured is not None:  # rows read from the capture's shards during training
        row = captured.row
        captured.row = lambda index: reads.append(index) or row(index)
    train(cfg, parts=parts, progress=False)
    if parts.device.type == "cuda":
        extra["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return {"arm": name, "overrides": arm, **window_rates(work / name / "metrics.jsonl"),
            "capture_rows_read": len(reads), **extra}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--work", required=True, help="folder for the capture and the three runs")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per arm")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=["target", "capture", "memory"])
    ap.add_argument("--out", help="JSON file of the results")
    args = ap.parse_args(argv)
    work = Path(args.work)
    cfg = load_config(args.config, [*args.overrides, f"run_dir={work / 'capture_run'}"])
    device = resolve_device(cfg.device)
    result = {"config": args.config, "overrides": args.overrides, "steps": args.steps,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
              "torch": torch.__version__}
    if {"capture", "memory"} & set(args.arms):
        done_before = (work / "capture" / MANIFEST).is_file()
        t = time.perf_counter()
        manifest = capture(cfg, work / "capture")
        seconds = time.perf_counter() - t
        tokens = sum(int(safe_open(str(work / "capture" / s["file"]), framework="pt").get_tensor("offsets")[-1])
                     for s in manifest["shards"])
        result["capture"] = {"rows": manifest["fingerprint"]["rows"], "tokens": tokens, "reused": done_before,
                             "seconds": seconds, "tokens_per_s": None if done_before else tokens / seconds}
    result["arms"] = {name: run_arm(name, args.config, args.overrides, work, args.steps) for name in args.arms}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
