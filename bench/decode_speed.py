"""Target-only decoding speed of a SmolLM2-135M-shaped model (random weights: speed does not
depend on them; no EOS, so every row decodes exactly --new-tokens), as transformers runs it:
  dynamic  eager forward, DynamicCache (grows by concatenation): what `eval` measured before
  static   StaticCache preallocated to prompt + new tokens; on CUDA transformers compiles the decode
           step (CUDA graphs)
at batch 1 and 8 (speculative decoding's shapes), and the batched regeneration engines of the local
backend (padded vs static) at a large batch.
    python bench/decode_speed.py --out decode.json            # GPU
    python bench/decode_speed.py --tiny                       # CPU smoke (CI)
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
               max_position_embeddings=8192, rope_theta=100000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024)


def decode(model, batch: int, prompt_len: int, new_tokens: int, cache: str, device, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=gen).to(device)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0, cache_implementation=cache if cache == "static" else None)
    times = []
    for i in range(repeats + 1):  # the first call compiles (static on CUDA) and is not counted
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    sec = sorted(times[1:])[len(times[1:]) // 2]
    return {"cache": cache, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "first_call_s": round(times[0], 2), "median_s": round(sec, 4),
            "tokens_per_s": round(batch * new_tokens / sec, 1), "ms_per_step": round(1e3 * sec / new_tokens, 3)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU: a tiny model, few tokens")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--engine-batch", type=int, default=1024, help="batch of the regeneration-engine rows")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    shape = TINY if args.tiny else SMOLLM2
    new = 8 if args.tiny else args.new_tokens
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**shape))
    model.to(torch.float32 if device.type == "cpu" else torch.bfloat16).eval().requires_grad_(False)
    model.generation_config = GenerationConfig()  # no default top_k etc.: the plain argmax
    rows = []
    with torch.no_grad():
        for batch in (1, 8):
            for cache in ("dynamic", "static"):
                rows.append(decode(model, batch, args.prompt_len, new, cache, device, 3))
                print(json.dumps(rows[-1]), flush=True)
        engine_batch = 4 if args.tiny else args.engine_batch
        for cache in ("dynamic", "static"):
            rows.append(decode(model, engine_batch, args.prompt_len, min(new, 128), cache, device, 1))
            print(json.dumps(rows[-1]), flush=True)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "shape": "tiny" if args.tiny else "smollm2-135m", "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
