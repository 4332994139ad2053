"""Tokenising speed of `prepare` (data/dataset.py tokenize_files): conversations per second.

Builds ROWS distinct single-turn conversations from a prompt file: each prompt, answered by the
text of the prompts after it up to --answer-chars characters (the length of a regenerated answer:
SmolLM2's ~333 tokens are ~1,500 characters), then tokenises them through the target's chat
template, in process (`data.tokenize_workers=0`) and with each pool size given.
    python bench/tokenize_speed.py --prompts data/every/train_prompts.jsonl --rows 40000 --workers 0 16
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

from dflash_train.data.dataset import tokenize_files
from dflash_train.data.prompts import load_prompts
from dflash_train.targets.tokenizer import load_tokenizer, resolve_target_path


def conversations(prompts: list[str], rows: int, answer_chars: int) -> list[dict]:
    cycle = itertools.cycle(prompts)
    out = []
    for i in range(rows):
        answer = ""
        while len(answer) < answer_chars:
            answer += next(cycle) + "\n"
        out.append({"messages": [{"role": "user", "content": f"{i}: {prompts[i % len(prompts)]}"},
                                 {"role": "assistant", "content": answer[:answer_chars]}]})
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="a prompt file (`dflash-train prompts` output) or set name")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--rows", type=int, default=40000)
    ap.add_argument("--answer-chars", type=int, default=1500)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--workers", type=int, nargs="+", default=[0])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    prompts = [p.turns[0] for p in load_prompts(args.prompts, None)]
    tokenizer = load_tokenizer(resolve_target_path(args.target))
    result = {"rows": args.rows, "answer_chars": args.answer_chars, "target": args.target, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "rows.jsonl"
        data.write_text("".join(json.dumps(c) + "\n" for c in conversations(prompts, args.rows, args.answer_chars)))
        for workers in args.workers:
            start = time.perf_counter()
            ds = tokenize_files([str(data)], tokenizer, args.max_length, True, workers=workers)
            seconds = time.perf_counter() - start
            run = {"workers": workers, "seconds": round(seconds, 2), "rows_per_s": round(len(ds) / seconds),
                   "tokens": int(ds.lengths.sum())}
            print(json.dumps(run), flush=True)
            result["runs"].append(run)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
