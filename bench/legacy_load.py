"""Does a converted target load the same in another transformers? Run once per version, then compare.

    python bench/legacy_load.py MODEL_DIR --save ids_logits_5.pt                  # transformers 5.x
    PYTHONPATH=/path/to/transformers-4.57 python bench/legacy_load.py MODEL_DIR --save ids_logits_4.pt
    python bench/legacy_load.py --compare ids_logits_5.pt ids_logits_4.pt

The text mixes prose, code, CJK and an emoji; the long input (700 tokens) runs past Gemma 3's
512-token window. Results: docs/families.md.
"""

from __future__ import annotations

import argparse

import torch

TEXT = "The capital of France is Paris.\n\nWrite a Python function that returns the sum of two numbers. 東京 🙂"


def record(model_dir: str) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(TEXT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
        long = model(torch.tensor([(ids * 60)[:700]])).logits[0, -5:]
    print(transformers.__version__, type(tokenizer).__name__, len(tokenizer))
    return {"version": transformers.__version__, "ids": ids, "logits": logits, "long": long}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument("--save")
    parser.add_argument("--compare", nargs=2)
    args = parser.parse_args()
    if args.compare:
        a, b = (torch.load(p) for p in args.compare)
        print(f"{a['version']} vs {b['version']}: token ids equal {a['ids'] == b['ids']}, max |logit difference| "
              f"{(a['logits'] - b['logits']).abs().max().item():.3g} (700-token input: "
              f"{(a['long'] - b['long']).abs().max().item():.3g})")
    else:
        torch.save(record(args.model_dir), args.save)


if __name__ == "__main__":
    main()
