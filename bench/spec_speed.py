"""Speculative decoding speed as served (eval/served_speed.py): static KV caches and CUDA graphs for
the target alone and for DFlash (drafter + block verification), at batch 1 and 8, greedy.
Reports tokens/s of both, speedup, tau, the per-round time split, and how many bf16 answers differ
from the target-only ones (each first difference with the target's top-2 logit gap).
    python bench/spec_speed.py --target smollm2 --drafter EXPORT_DIR --out spec_speed.json   # GPU
    python bench/spec_speed.py --target smollm2 --random-drafter --out spec_speed.json       # tau ~1
    python bench/spec_speed.py --tiny                                                        # CPU smoke (CI)
On a GPU the steps are compiled (torch.compile) and then captured; a step that does not compile runs
uncompiled (`compiled` lists those that did, `compile_error` says why), a graph capture that fails
falls back to eager decoding (`graphs: false`, `graph_error` says why); a batch size that fails is
recorded with its error and the others still run. Target-only batch 1, compiled against not:
    python bench/spec_speed.py --random-drafter --batch 1 --out compiled.json
    python bench/spec_speed.py --random-drafter --batch 1 --no-compile --out uncompiled.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_train.config import RunConfig  # noqa: E402
from dflash_train.config_model import TargetConfig
from dflash_train.eval.export import load_drafter  # noqa: E402
from dflash_train.data.prompts import load_prompts  # noqa: E402
from dflash_train.eval.report import encode, stop_token_ids  # noqa: E402
from dflash_train.eval.served_speed import served_speed  # noqa: E402
from dflash_train.targets.model import load_target  # noqa: E402
from dflash_train.train.drafter_init import build_drafter  # noqa: E402

log = logging.getLogger("dflash_train")


def tiny_setup():
    """A random 4-layer Qwen3 target and drafter on CPU in fp32, random prompts (no files needed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from eval.tiny_models import tiny_drafter, tiny_target

    target = tiny_target()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 255, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    return target, tiny_drafter(target), prompts, []


def real_setup(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(TargetConfig(path=args.target, dtype=args.dtype), device)
    if args.random_drafter:
        cfg = RunConfig.model_validate({"target": {"path": args.target},
                                        "draft": {"num_layers": args.draft_layers},
                                        "objective": {"block_size": args.block_size,
                                                      "mask_token_id": args.mask_token_id}})
        drafter = build_drafter(cfg, target, device).to(target.embed_weight.dtype).eval().requires_grad_(False)
    else:
        drafter = load_drafter(args.drafter, target, device)
    prompts = []
    for p in load_prompts(args.prompts):  # the first N whose first turn fits the prompt limit
        ids = encode(target, p.messages([]))[0].tolist()
        if len(ids) <= args.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == args.num_prompts:
            break
    return target, drafter, prompts, stop_token_ids(target)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2", help="HF model dir/id or smollm2 (default: smollm2)")
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--drafter", help="training checkpoint or export dir")
    source.add_argument("--random-drafter", action="store_true", help="a random-init drafter (speed only, tau ~1)")
    ap.add_argument("--draft-layers", type=int, default=1, help="random drafter's layers (default: 1)")
    ap.add_argument("--block-size", type=int, default=16, help="random drafter's block size (default: 16)")
    ap.add_argument("--mask-token-id", type=int, default=16,
                    help="random drafter's mask token (default: 16, SmolLM2's <empty_output>, as its configs)")
    ap.add_argument("--prompts", default="sharegpt",
                    help="sharegpt, humaneval, mt-bench or a JSONL (default: sharegpt)")
    ap.add_argument("--num-prompts", type=int, default=20, help="first turns decoded (default: 20)")
    ap.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are skipped (default: 1024)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per answer (default: 256)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="rows decoded together (default: 1 8)")
    ap.add_argument("--dtype", default="bfloat16", help="target and drafter dtype (default: bfloat16)")
    ap.add_argument("--no-graphs", action="store_true", help="decode eagerly even on a GPU (and uncompiled)")
    ap.add_argument("--no-compile", action="store_true", help="capture the uncompiled steps (eager kernels)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: tiny random models and prompts")
    ap.add_argument("--out", help="JSON file to write")
    args = ap.parse_args(argv)
    if not (args.tiny or args.drafter or args.random_drafter):
        ap.error("one of --drafter DIR, --random-drafter or --tiny is needed")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t0 = time.perf_counter()
    target, drafter, prompts, stop_ids = tiny_setup() if args.tiny else real_setup(args)
    new_tokens = 8 if args.tiny else args.max_new_tokens
    result = {"device": torch.cuda.get_device_name() if target.device.type == "cuda" else "cpu",
              "torch": torch.__version__, "target": "tiny" if args.tiny else args.target,
              "drafter": "tiny" if args.tiny else args.drafter or f"random ({args.draft_layers} layers)",
              "dtype": str(target.embed_weight.dtype), "block_size": drafter.config.block_size,
              "prompts": len(prompts), "max_new_tokens": new_tokens, "load_s": round(time.perf_counter() - t0, 1),
              "runs": []}
    for rows in args.batch:
        t = time.perf_counter()
        try:
            run = served_speed(target, drafter, prompts, new_tokens, stop_ids, rows,
                               graphs=False if args.no_graphs else None, compile=False if args.no_compile else None)
        except Exception as e:  # one batch size failing must not lose the others' figures
            log.exception("batch %d failed", rows)
            run = {"rows": rows, "error": f"{type(e).__name__}: {e}"}
        run["wall_s"] = round(time.perf_counter() - t, 1)
        result["runs"].append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "differences"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
