"""Steady-state recompiles on GPU: the real training loop over varying-length data (H200).

A random-init Qwen3-shaped target (no download), compiled draft layers + compiled flex_attention,
token-budget batches of varying size and length (length buckets of 256). Prints compiled graphs
and recompiles after warm-up per logged step; the goal is zero after warm-up.
    python bench/recompiles.py --steps 200 --out recompiles.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny import tiny_tokenizer  # noqa: E402

from dflash_train.config import build_config  # noqa: E402
from dflash_train.data.dataset import TokenizedDataset  # noqa: E402
from dflash_train.targets.model import Target  # noqa: E402
from dflash_train.train.build import build  # noqa: E402
from dflash_train.train.loop import train  # noqa: E402
from dflash_train.train.metrics import read_metrics  # noqa: E402


def random_dataset(n: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> TokenizedDataset:
    rng = np.random.default_rng(seed)
    ds = TokenizedDataset()
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(1, max(2, length // 3)))
        ds.append(rng.integers(0, vocab - 300, length), np.r_[np.zeros(prompt), np.ones(length - prompt)])
    ds.stats.ok = n
    return ds


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    shape = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(Qwen3Config(**shape))
    model.to(torch.bfloat16).eval().requires_grad_(False)
    target = Target(model=model, tokenizer=tiny_tokenizer(), name="qwen3-2b-shaped-random", device=torch.device("cuda"))
    run_dir = tempfile.mkdtemp(prefix="recompiles-", dir=str(Path.home()))
    cfg = build_config({
        "run_dir": run_dir, "device": "cuda",
        "draft": {"num_layers": 2, "attention": "flex"},
        "objective": {"block_size": 16, "mask_token_id": 151669, "num_anchors": 256},
        "data": {"max_length": 2048, "token_budget": 8192, "max_batch_size": 8, "length_bucket": 256},
        "train": {"lr": 6e-4, "max_steps": args.steps, "log_every": 10, "compile": True,
                  "compile_warmup_steps": 20},
        "checkpoint": {"every": 10**6},
    })
    train(cfg, parts=build(cfg, target, random_dataset(4000, 200, 2048, shape["vocab_size"])), progress=False)
    rows = [{k: m[k] for k in ("step", "tokens_per_s", "compiled_graphs", "recompiles_since_warmup", "loss")}
            for m in read_metrics(run_dir)]
    result = {"steps": args.steps, "compile_warmup_steps": 20, "log": rows,
              "recompiles_after_warmup": rows[-1]["recompiles_since_warmup"],
              "compiled_graphs": rows[-1]["compiled_graphs"]}
    print(json.dumps({k: v for k, v in result.items() if k != "log"}, indent=2))
    for r in rows:
        print(r)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
