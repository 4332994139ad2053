"""Generated tokens/s of the in-process backend's engines on one device, side by side.

A random-init target of a given shape answers N random-token prompts (lengths drawn like chat
prompts) with M new tokens each and no stop token, so every engine does the same work:
  padded       one left-padded `generate` per batch of B prompts (the backend's default)
  static       the same on transformers' static cache (decode step compiled on a GPU)
  continuous   transformers' continuous batching over all N at once (paged KV cache, CUDA graphs)
  graphed      ours: B rows on a static per-row cache, finished rows refilled, one compiled CUDA graph per step
Real answers end at different lengths, which costs the padded engines more (finished rows keep
running until the batch's longest ends) and the refilling ones nothing: this bench is their lower bound.

    PYTHONPATH=. python bench/generate_local.py --prompts 1024 --new-tokens 128 --out gen.json
    PYTHONPATH=. python bench/generate_local.py --shape tiny --prompts 8 --new-tokens 8   # CPU check
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_train.decode.sampling import GenParams
from dflash_train.decode.greedy import generate_ids, graphed_generate

SHAPES = {
    # SmolLM2-135M-Instruct (the H200 example's target): 30 layers, 576 wide, 9 heads, 3 KV heads.
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g)
    return [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in lengths]


def run_engine(model, prompts, params, engine: str, batch: int) -> dict:
    """Wall time and tokens/s for answering `prompts`: batches of `batch` (padded, static), `batch`
    rows (graphed, its graph capture included), all at once (continuous)."""
    batched = engine in ("padded", "static")
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)] if batched else [prompts]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    if engine == "graphed":
        answers = graphed_generate(model, prompts, params, set(), 0, rows=batch)
    else:
        answers = [a for group in groups for a in generate_ids(model, group, params, set(), 0, engine)]
    tokens = sum(len(ids) for ids, _ in answers)
    sync()
    seconds = time.perf_counter() - t0
    return {"engine": engine, "batch": batch if engine != "continuous" else len(prompts), "seconds": round(seconds, 2),
            "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[60, 450], metavar=("MIN", "MAX"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1024, 256],
                    help="batch sizes of the padded and static engines, rows of the graphed one")
    ap.add_argument("--engines", nargs="+", default=["padded", "continuous"],
                    choices=["padded", "static", "continuous", "graphed"])
    ap.add_argument("--out")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape])).to(device, dtype).eval()
    model.generation_config.eos_token_id = None  # no stop token: every engine generates every token
    prompts = random_prompts(args.prompts, model.config.vocab_size, *args.prompt_tokens)
    params = GenParams(temperature=0.0, top_p=1.0, max_tokens=args.new_tokens)
    for engine in args.engines:  # kernels, allocator, graph capture: not part of the timed runs
        generate_ids(model, prompts[:8], GenParams(temperature=0.0, top_p=1.0, max_tokens=4), set(), 0, engine)

    runs = []
    for engine in args.engines:
        for batch in args.batches if engine != "continuous" else [len(prompts)]:
            runs.append(run_engine(model, prompts, params, engine, batch))
            print(json.dumps(runs[-1]), flush=True)
    report = {"shape": args.shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "prompts": args.prompts, "new_tokens": args.new_tokens,
              "prompt_tokens": args.prompt_tokens, "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
