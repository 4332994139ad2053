"""Regeneration speed of the graphed engine on real prompts, beside its own step at fixed contexts
and the bandwidth roofline.

The target answers the prompts of a real prompt file (greedy, at most --max-tokens each, its own
stop tokens: answers end where the model ends them) through `GraphedEngine`, once per variant:
  sdpa   the step as a CUDA graph of eager kernels, SDPA over the whole cache under a mask
  flex   the step compiled, then captured; attention reads each row only up to its position
Per variant: answer tokens/s (the first cache build, compilation included, timed apart), the mean
context a decoded token attended to, and the roofline at that context: the bytes one step must
read (weights, the K/V up to each row's position, the logits) over the copy bandwidth measured
in the same run. `--plain` times the captured step alone with every row at one context, as a
serving engine's step would run with no refill; `--profile`, the CUDA kernels of that step (a
random-weight model of the target's shape, `--model smollm2-shape`, serves for both);
`--profile-prefill`, one prefill of the first prompts replayed after the job: its time, rate and
kernels.
Each job's GPU time is split into steps, prefills and idle gaps by the engine's own marks
(decode/launch_timeline.py), over the whole job and its middle half. `--check N`: N prompts in
fp32, the engine's answers against transformers' padded `generate` (equal, token for token).
`--flex-options JSON`: flex decoding's kernel options (e.g. '{"num_stages": 3, "num_warps": 4}'),
inductor's own when not given. `--prefill packed|padded`: how prompts are prefilled (auto: packed
where the model allows it); `--compile-prefill`: the packed prefills' forward compiled before it is
captured.

    PYTHONPATH=. python3 bench/regen_speed.py --prompts data/every/train_prompts.jsonl --num 8192 \
        --rows 1024 --variants sdpa flex --plain 256 512 --check 64 --out regen.json    # one GPU
    PYTHONPATH=. python3 bench/regen_speed.py --model tiny --num 6 --rows 2 --max-tokens 8    # CPU check
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path

import torch

from dflash_train.data.formats import iter_rows, normalise_messages
from dflash_train.decode.sampling import GenParams
from dflash_train.decode.graphed_engine import GraphedEngine, Job
from dflash_train.decode.greedy import generate_ids, pad_token_id
from dflash_train.generate.local_backend import encode_prompt, stop_ids
from dflash_train.decode import flex_decode
from throughput import sync, timed  # bench/: the same timing as the training benchmark

VARIANTS = {"sdpa": dict(compile=False, attention="sdpa"), "flex": dict(compile=True, attention="flex")}


RANDOM = {
    # random weights, no tokenizer, no stop: the step's speed and kernels (--plain, --profile)
    "smollm2-shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),  # CPU check
}


def load(model_name: str, device: torch.device, dtype: torch.dtype):
    if model_name in RANDOM:
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**RANDOM[model_name])).to(device, dtype).eval().requires_grad_(False), None
    from dflash_train.config_model import TargetConfig
    from dflash_train.targets.model import load_target
    target = load_target(TargetConfig(path=model_name, dtype=str(dtype).removeprefix("torch.")), device)
    return target.model, target.tokenizer


def prompt_ids(path: str | None, tokenizer, num: int) -> list[list[int]]:
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(1, 512, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (num,), generator=g)]
    prompts = []
    for where, row in iter_rows(Path(path).resolve()):
        prompts.append(encode_prompt(tokenizer, normalise_messages(row, where), None))
        if len(prompts) == num:
            break
    return prompts


def progress(message: str) -> None:
    """Where a long run is (stderr, timed): a run cut by a time limit still says how far it got."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def serve(engine: GraphedEngine, jobs: list[Job]) -> None:
    waiting = deque(jobs)
    engine.serve(lambda n: [waiting.popleft() for _ in range(min(n, len(waiting)))], lambda job: None)


def gpu_timeline(timeline) -> dict:
    """The engine's GPU clock over the whole job, and over its middle half (steady state: the rows
    full, before the drain)."""
    n = len(timeline.spans)
    return {"whole_job": timeline.summary(), "middle_half": timeline.summary(timeline.spans[n // 4: 3 * n // 4])}


def copy_bandwidth(device) -> float | None:
    """Bytes/s of a 4 GiB device-to-device copy (read + written), the memory roofline's ceiling."""
    if device.type != "cuda":
        return None
    a = torch.empty(1 << 30, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    sync(device)
    return 10 * 2 * a.numel() * 4 / (start.elapsed_time(end) / 1e3)


def step_bytes(model, rows: int, context: float) -> float:
    """What one decode step must move at least: the weights once, each row's K/V up to `context`,
    the logits written and read back in fp32 for the sampler."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    kv = rows * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element * context
    return weights + kv + rows * config.vocab_size * 4 * 2


def run_variant(model, prompts, args, stops, pad_id, name: str, bandwidth: float) -> dict:
    engine = GraphedEngine(model, args.rows, stops, pad_id, prefill=args.prefill, compile_prefill=args.compile_prefill,
                           **VARIANTS[name])
    t0 = time.perf_counter()
    # the cache every prompt fits, and the plain steps' contexts: built once
    engine._build(max(max(map(len, prompts)) + args.max_tokens + 1, max(args.plain, default=0) + 2 * PLAIN_STEPS))
    build_s = time.perf_counter() - t0
    progress(f"{name}: cache of {engine.length} positions built in {build_s:.1f} s; serving {len(prompts)} prompts")
    jobs = [Job(p, args.max_tokens) for p in prompts]
    sync(engine.device)
    t0 = time.perf_counter()
    serve(engine, jobs)
    sync(engine.device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(j.tokens) for j in jobs)
    progress(f"{name}: served {tokens} tokens in {seconds:.1f} s")
    context = sum(len(j.prompt) * len(j.tokens) + len(j.tokens) * (len(j.tokens) - 1) / 2 for j in jobs) / tokens
    roofline = bandwidth and args.rows * bandwidth / step_bytes(model, args.rows, context)
    result = {"variant": name, "rows": args.rows, "answers": len(jobs), "answer_tokens": tokens,
              "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds), "build_s": round(build_s, 1),
              "cache_length": engine.length, "mean_context": round(context, 1), "packed_prefills": engine.packed,
              "stopped": sum(j.stopped for j in jobs), "roofline_tokens_per_s": roofline and round(roofline),
              "compiled": engine.steps.compiled, "graphed": engine.steps.graphed,
              "compile_error": engine.steps.compile_error, "graph_error": engine.steps.graph_error,
              "prefill_compiled": engine.compile_prefill and engine.prefills.compiled is not None,
              "prefill_compile_error": engine.compile_prefill and engine.prefills.compile_error or None,
              "timings": vars(engine.timings), "gpu_timeline": gpu_timeline(engine.timeline)}
    if args.plain:
        result["plain"] = [plain_step(engine, context, bandwidth) for context in args.plain]
    if args.profile:
        result["profile"] = profile(engine, args.plain[0] if args.plain else 256)
    if args.profile_prefill:
        result["prefill_profile"] = prefill_profile(engine, prompts)
    return result, [j.tokens for j in jobs]


PLAIN_STEPS = 64


def plain_step(engine: GraphedEngine, context: int, bandwidth: float, steps: int = PLAIN_STEPS) -> dict:
    """The captured step alone, every row at `context` (cache positions past it: the engine's own)."""
    engine.pos.fill_(context)
    engine.cap.fill_(context + 10 * steps)
    ms = 1e3 * timed(engine.steps.run["greedy"], engine.device, steps, warmup=2)
    roofline = bandwidth and engine.rows * bandwidth / step_bytes(engine.model, engine.rows, context + steps / 2)
    return {"context": context, "cache_length": engine.length, "ms_per_step": round(ms, 3),
            "tokens_per_s": round(engine.rows * 1e3 / ms), "roofline_tokens_per_s": roofline and round(roofline)}


def profile(engine: GraphedEngine, context: int, steps: int = 16) -> list[dict]:
    """The CUDA kernels of `steps` captured steps (after plain_step: rows at `context`), by time."""
    engine.pos.fill_(context)
    return kernels(engine.steps.run["greedy"], steps, engine.device)


def kernels(fn, times: int, device) -> list[dict]:
    """The CUDA kernels of `times` calls of `fn`, by time, per call."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(times):
            fn()
        sync(device)
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:20]
    return [{"name": e.key[:100], "ms_per_call": round(e.device_time_total / 1e3 / times, 3), "calls_per_call": e.count / times}
            for e in events if e.device_time_total > 0]


def decoder_parameters(model) -> int:
    """The decoder layers' parameters (and final norm): what every prompt token multiplies through
    (the embedding is a lookup; the LM head runs for the last token only)."""
    decoder = model.get_decoder()
    return sum(p.numel() for p in decoder.parameters()) - decoder.get_input_embeddings().weight.numel()


def prefill_profile(engine: GraphedEngine, prompts: list[list[int]], times: int = 8) -> dict:
    """One prefill of the first prompts (as many as one of the engine's prefills takes, at most its
    rows) into rows 0..n-1, replayed `times` times after the job: ms a prefill, prompt tokens/s, the
    TFLOP/s of 2 x the decoder layers' parameters a token, and its CUDA kernels by time."""
    prompts = prompts[: engine.rows]
    batch = [prompts[i] for i in engine.prefills.pieces([len(p) for p in prompts])[0]]
    rows = list(range(len(batch)))
    run = lambda: engine.prefills.run(batch, rows)  # noqa: E731
    seconds = timed(run, engine.device, times, warmup=1)
    tokens = sum(map(len, batch))
    flops = 2 * decoder_parameters(engine.model) * tokens
    return {"packed": engine.packed, "prompts": len(batch), "prompt_tokens": tokens, "ms": round(1e3 * seconds, 3),
            "gflop": round(flops / 1e9, 6), "prompt_tokens_per_s": round(tokens / seconds),
            "tflops": round(flops / seconds / 1e12, 3),
            "kernels": kernels(run, 3, engine.device) if engine.device.type == "cuda" else []}


def check(model, prompts, args, stops, pad_id) -> dict:
    """fp32: the compiled flex engine's answers against the padded `generate`, token for token."""
    model = model.float()
    params = GenParams(temperature=0.0, top_p=1.0, max_tokens=args.check_tokens)
    padded = generate_ids(model, prompts, params, stops, pad_id)
    engine = GraphedEngine(model, min(args.rows, len(prompts) // 2 or 1), stops, pad_id, **VARIANTS["flex"])
    jobs = [Job(p, args.check_tokens) for p in prompts]
    serve(engine, jobs)
    equal = sum((j.tokens, j.stopped) == tuple(p) for j, p in zip(jobs, padded))
    return {"prompts": len(prompts), "max_tokens": args.check_tokens, "equal": equal, "flex": engine.flex,
            "compiled": engine.steps.compiled}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", help="a JSONL/Parquet prompt file (messages)")
    ap.add_argument("--num", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--variants", nargs="+", default=["sdpa", "flex"], choices=sorted(VARIANTS))
    ap.add_argument("--plain", type=int, nargs="*", default=[], metavar="CONTEXT")
    ap.add_argument("--check", type=int, default=0, metavar="N")
    ap.add_argument("--check-tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-prefill", action="store_true")
    ap.add_argument("--flex-options", type=json.loads, default={}, metavar="JSON")
    ap.add_argument("--prefill", default="auto", choices=["auto", "packed", "padded"])
    ap.add_argument("--compile-prefill", action="store_true", help="the packed prefills' forward compiled too")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.prompts and args.model in RANDOM:
        ap.error(f"--prompts needs a model with a tokenizer; {args.model} has random weights and none "
                 "(its prompts are random token ids)")
    flex_decode.KERNEL_OPTIONS.update(args.flex_options)  # read when the step compiles, below

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load(args.model, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    stops = stop_ids(model, tokenizer) if tokenizer is not None else set()
    pad_id = pad_token_id(tokenizer, stops) if tokenizer is not None else 0
    prompts = prompt_ids(args.prompts, tokenizer, args.num)
    bandwidth = copy_bandwidth(device)
    report = {"model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "prompts": len(prompts), "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
              "prompt_tokens_max": max(map(len, prompts)), "copy_bandwidth_gbs": bandwidth and round(bandwidth / 1e9), "flex_options": args.flex_options, "runs": []}
    answers = {}
    for name in args.variants:
        result, answers[name] = run_variant(model, prompts, args, stops, pad_id, name, bandwidth)
        report["runs"].append(result)
        print(json.dumps(result), flush=True)
    if len(answers) == 2:
        a, b = answers.values()
        report["same_answers_across_variants"] = sum(x == y for x, y in zip(a, b))
    if args.check:
        report["fp32_check"] = check(model, prompts[: args.check], args, stops, pad_id)
        print(json.dumps(report["fp32_check"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
