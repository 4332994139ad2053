"""Set up a distributed GPU run without downloads: a random-init Qwen3-shaped target saved as an HF
model dir, a prepared dataset of random-token conversations with realistic lengths, a run config.
    python bench/dist_setup.py --out runs/dist --shape qwen3-8b
    dflash-train launch -c runs/dist/run.yaml --colocated --nproc-per-node 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from recompiles import random_dataset  # noqa: E402
from throughput import SHAPES  # noqa: E402
from tiny import tiny_tokenizer  # noqa: E402

from dflash_train.data.dataset import save_prepared  # noqa: E402
from dflash_train.targets.tokenizer import tokenizer_fingerprint  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--max-length", type=int, default=3072)
    ap.add_argument("--min-length", type=int, help="shortest conversation (default max_length / 3); "
                    "= max_length gives one static shape, the performance issue's")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--anchors", type=int, default=512)
    args = ap.parse_args(argv)
    out = Path(args.out)
    shape = SHAPES[args.shape]
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (out / "target" / "config.json").is_file():  # the same seed gives the same target: keep it
        with torch.device(device):
            model = Qwen3ForCausalLM(Qwen3Config(**shape, tie_word_embeddings=False, max_position_embeddings=32768))
        model.to(torch.bfloat16).save_pretrained(out / "target")
        tokenizer.save_pretrained(out / "target")
        del model
    ds = random_dataset(args.rows, args.min_length or args.max_length // 3, args.max_length, shape["vocab_size"])
    save_prepared(ds, out / "data", tokenizer_fingerprint(tokenizer), args.max_length)
    cfg = {
        "run_dir": str(out / "run"), "device": device,
        "target": {"path": str(out / "target"), "dtype": "bfloat16" if device == "cuda" else "float32"},
        "draft": {"num_layers": 5, "attention": "flex" if device == "cuda" else "sdpa"},
        "objective": {"block_size": 16, "mask_token_id": shape["vocab_size"] - 1, "num_anchors": args.anchors},
        "data": {"train_files": [str(out / "data")], "max_length": args.max_length, "token_budget": args.max_length,
                 "max_batch_size": 1},
        "train": {"max_steps": args.steps, "log_every": 10, "compile": device == "cuda"},
        "checkpoint": {"every": 10**6, "keep_last": 1},
    }
    (out / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(out / "run.yaml")


if __name__ == "__main__":
    main()
