"""Training throughput: isolated target, isolated drafter, end-to-end colocated, MFU.

GPU (the performance issue's shape): Qwen3-8B-shaped random-init target (no download), 5-layer
drafter, max_length 3072, 512 anchors, block 16, lengths drawn from a realistic spread.
    python bench/throughput.py --compile --out bench_h200.json
SmolLM2-135M-shaped target with the real-data run's step (about 40 sequences x 256 anchors):
    python bench/throughput.py --shape smollm2 --batch 40 --max-length 1024 --anchors 256 --draft-layers 4
CPU (kept working by CI): a tiny config.
    python bench/throughput.py --tiny --steps 3
MFU counts every matmul over the tokens it runs and attention over the pairs its mask lets attend
(bench/flops.py), against a bf16 matmul rate measured in the same run; `--recount RECORD` counts an
older record's again from its rates. Besides the three headline rates, each run measures levers side by side
on the same models: end-to-end with the next target forward on a second CUDA stream (overlap),
the foreach instead of the fused AdamW, the host syncs of one end-to-end step, the drafter step
with its block task (anchors, labels) drawn inside it as the training loop does, and the block
mask built from the anchors' tiles against torch's `create_block_mask` over the same rule.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from dflash_train.config import build_config
from dflash_train.draft import masks
from dflash_train.draft.build import drafter_for
from dflash_train.draft.fp8 import RECIPES, convert_to_fp8
from dflash_train.draft.fp8_head import Fp8Head
from dflash_train.draft.objective import draft_loss, make_task
from dflash_train.families import FAMILIES, family
from dflash_train.targets.fp8 import GRANULARITIES, quantize_decoder
from dflash_train.targets.model import Target, compile_decoder
from dflash_train.checks.compile_settings import settings_for_manifest
from dflash_train.checks.profile import profile_callable
from dflash_train.train.forward import loss_mix
from dflash_train.train.shapes import draft_model_config, stream_layer_ids
from dflash_train.train.optim import build_optimizer
from flops import drafter_flops, target_flops  # noqa: E402  (bench/, beside this file)

SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    # SmolLM2-135M's dimensions (a Llama; Qwen3's q/k norms add next to nothing): the real-data run's target
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
}


class _NoTokenizer(PreTrainedTokenizerFast):
    """Random-token benchmark: only the mask-token lookup touches the tokenizer."""

    def __init__(self):
        pass

    mask_token_id = None

    def __len__(self):
        return 151669


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - t) / steps


def matmul_tflops(device) -> float:
    if device.type != "cuda":
        return None
    n = 8192
    a, b = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16)
    sec = timed(lambda: a @ b, device, 20, 5)
    return 2 * n**3 / sec / 1e12


def is_sync_warning(message: str) -> bool:
    """A warning of the sync debug mode about a synchronising call. Switching the mode on also warns
    ("Synchronization debug mode is a prototype feature..."): that one is no sync (it was counted as
    one until the "error" mode, which raised nothing in the same step, showed it on the H200)."""
    return "called a synchronizing CUDA operation" in message


def host_syncs(fn, device) -> list[str] | None:
    """The synchronising CUDA calls of one call of `fn`, counted with torch's sync debug mode
    ("warn"), each as the Python line its warning was raised at. A warning can surface late, at the
    next call into torch, so its line may name no culprit: first_sync finds the call."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if is_sync_warning(str(w.message))]


def first_sync(fn, device) -> list[str] | None:
    """The innermost Python frames of the first synchronising CUDA call of `fn`, which the "error"
    sync debug mode turns into an exception at the call itself (fn is cut short there: run last)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as err:
        if not is_sync_warning(str(err)):
            raise
        return [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_tb(err.__traceback__)[-8:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return []


def make_batch(shape: str, batch: int, max_length: int, device, gen, full: bool = False):
    # Realistic spread: lengths 40%..100% of max_length (or all full), prompt = first 15%.
    low = max_length if full else int(0.4 * max_length)
    lengths = torch.randint(low, max_length + 1, (batch,), generator=gen)
    t = int(lengths.max())
    vocab = SHAPES[shape]["vocab_size"] - 300
    ids = torch.randint(0, vocab, (batch, t), generator=gen)
    pos = torch.arange(t)[None]
    attn = (pos < lengths[:, None]).long()
    loss_mask = attn * (pos >= (0.15 * lengths[:, None]).long())
    return ids.to(device), loss_mask.to(device), lengths.tolist()


def measure_levers(args, device, cfg, drafter, target_step, draft_step, overlapped, ids, loss_mask, task, tokens) -> dict:
    """Each lever beside the headline rates, on the same models and batch."""
    levers = {}
    seeds = iter(range(1, 10**6))  # new anchors every step, as in training
    levers["drafter_with_task_steps_per_s"] = 1 / timed(
        lambda: draft_step(block_task=make_task(ids, loss_mask, cfg.objective, next(seeds))), device, args.steps, 1)
    context = ids.shape[1]
    block = cfg.objective.block_size
    levers["block_mask_ms"] = 1e3 * timed(lambda: masks.flex_block_mask(task.anchors, block, context), device,
                                          args.steps, 1)
    levers["block_mask_create_block_mask_ms"] = 1e3 * timed(
        lambda: create_block_mask(masks.mask_mod_for(task.anchors, block, context), task.anchors.shape[0], None,
                                  task.anchors.shape[1] * block, context + task.anchors.shape[1] * block,
                                  device=device),
        device, args.steps, 1)
    if device.type == "cuda":
        levers["e2e_overlap_tokens_per_s"] = tokens / timed(lambda: overlapped(args.steps), device, 1, 1) * args.steps
        foreach = torch.optim.AdamW(drafter.parameters(), lr=cfg.train.lr, betas=cfg.train.betas, foreach=True)
        levers["drafter_foreach_adamw_tokens_per_s"] = tokens / timed(lambda: draft_step(optimizer=foreach), device, args.steps, 1)
    return levers


def progress(started: float, message: str) -> None:
    """A phase's end on stderr, seconds since the start: a run cut by a time limit still says
    where its time went (the first timed call of each phase includes its compilation)."""
    print(f"[{time.perf_counter() - started:.0f} s] {message}", file=sys.stderr, flush=True)


def build_models(args, shape: str, anchors: int, device: torch.device, dtype: torch.dtype):
    """(the target's HF model, its Target, the run config, the drafter): random weights, seeded; on the
    meta device, shapes alone (`--recount`)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPES[shape], tie_word_embeddings=False, max_position_embeddings=32768))
    model.to(dtype).eval().requires_grad_(False)
    if args.fp8_target != "off":
        quantize_decoder(model.model.layers, args.fp8_target)
    target = Target(model=model, tokenizer=_NoTokenizer(), name=f"{shape}-random", device=device)
    if args.compile_target:
        compile_decoder(target)  # as target.compile does in training
    loss = {args.loss: 1.0, **{term: 1.0 for term in family(args.family).loss_terms}}
    cfg = build_config({"device": "cpu" if device.type == "meta" else device.type,
                        "draft": {"num_layers": 2 if args.tiny else args.draft_layers, "family": args.family},
                        "objective": {"block_size": 16, "mask_token_id": SHAPES[shape]["vocab_size"] - 1,
                                      "num_anchors": anchors, "loss": loss, "gamma": 7.0}})
    with torch.device("meta") if device.type == "meta" else contextlib.nullcontext():  # else seeded on the CPU
        drafter = drafter_for(draft_model_config(cfg, target)).to(device)
    drafter.recompute_layers = args.activation_checkpointing
    if args.fp8_draft != "off":
        convert_to_fp8(drafter, args.fp8_draft)
    if args.compile:
        for layer in drafter.layers:
            layer.compile()
    return model, target, cfg, drafter


def step_flops(model, drafter, cfg, lengths: list[int], task, context_len: int) -> dict:
    """One step's flops (bench/flops.py): the target's forward and the drafter's step, by kind."""
    layers_run = max(drafter.config.target_layer_ids) + 1
    distils = cfg.objective.needs_target_logits
    return {"target": target_flops(model.model.layers, model.config, lengths,
                                   model.config.num_hidden_layers if distils else layers_run),
            "drafter": drafter_flops(drafter, task.anchors, sum(lengths), context_len, model.config.vocab_size, distils)}


def mfu(flops: dict, seconds: float, peak_tflops: float | None) -> float | None:
    return peak_tflops and sum(flops.values()) / seconds / 1e12 / peak_tflops


def mfu_fields(flops: dict, seconds: dict, peak_tflops: float | None) -> dict:
    """A record's flops by kind and its three MFUs, from `step_flops` and each part's seconds a step."""
    both = {f"{part}_{kind}": n for part, kinds in flops.items() for kind, n in kinds.items()}
    return {"flops_per_step": both, "target_mfu": mfu(flops["target"], seconds["target"], peak_tflops),
            "drafter_mfu": mfu(flops["drafter"], seconds["drafter"], peak_tflops),
            "e2e_mfu": mfu(both, seconds["e2e"], peak_tflops)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU: a tiny config (what CI runs)")
    ap.add_argument("--shape", default="qwen3-8b", choices=["qwen3-8b", "smollm2"], help="target dimensions (GPU)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--max-length", type=int, default=3072)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--family", default="dflash", choices=list(FAMILIES),
                    help="the drafter's family (with the loss terms only it trains, e.g. dflash2's selector)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the draft layers")
    ap.add_argument("--compile-loss", action="store_true", help="torch.compile the loss chunks (train.compile_loss)")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="recompute each draft layer in the backward (train.activation_checkpointing); MFU counts no recompute")
    ap.add_argument("--full-length", action="store_true", help="every sequence max_length long (the shape of docs/design.md#reference-figures)")
    ap.add_argument("--loss", default="ce", choices=["ce", "kl", "target_argmax"],
                    help="per-slot loss (objective.loss): the target kinds also run the target's last layers and head")
    ap.add_argument("--ce-kernel", default="chunked", choices=["chunked", "liger", "cce"],
                    help="LM head + CE of the loss (train.ce_kernel): ours, or a fused library kernel (CUDA)")
    ap.add_argument("--ce-chunk-size", type=int, default=4096,
                    help="rows per LM-head chunk (objective.ce_chunk_size; the SmolLM2 recipe's is 24576)")
    ap.add_argument("--profile", action="store_true", help="time of one end-to-end step by kernel family, device busy and idle (dflash_train/checks/profile.py)")
    ap.add_argument("--fp8-draft", default="off", choices=["off", *RECIPES],
                    help="the drafter's linear layers in FP8 (draft.fp8, torchao float8 training)")
    ap.add_argument("--fp8-target", default="off", choices=["off", *GRANULARITIES],
                    help="the target's decoder in FP8 (target.fp8, torchao float8 inference)")
    ap.add_argument("--fp8-head", action="store_true",
                    help="the loss's LM head matmuls in FP8 (train.fp8_lm_head)")
    ap.add_argument("--compile-target", action="store_true",
                    help="torch.compile each decoder layer's forward of the target (target.compile)")
    ap.add_argument("--headline", action="store_true", help="the three rates, memory, syncs and recompiles only")
    ap.add_argument("--out")
    ap.add_argument("--recount", metavar="RECORD",
                    help="a record of this command (the same flags): its MFU counted again by bench/flops.py from its rates, no GPU")
    return ap.parse_args(argv)


def main(argv=None):
    started = time.perf_counter()
    args = parse_args(argv)
    shape = "tiny" if args.tiny else args.shape
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    max_length = 128 if args.tiny else args.max_length
    anchors = 16 if args.tiny else args.anchors
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.recount:
        return write(recount(args, shape, max_length, anchors), args.out)

    model, target, cfg, drafter = build_models(args, shape, anchors, device, dtype)
    opt = build_optimizer(drafter.parameters(), cfg.train, device)
    use_flex = device.type == "cuda"
    head = Fp8Head(target.lm_head_weight) if args.fp8_head else target.lm_head_weight
    layer_ids = stream_layer_ids(cfg, target)  # + the last layer when the loss distils
    mix = loss_mix(cfg.objective)  # as training forms it: D-PACE and the selector's options as configured
    progress(started, "models built")
    gen = torch.Generator().manual_seed(0)
    ids, loss_mask, lengths = make_batch(shape, args.batch, max_length, device, gen, args.full_length)
    tokens = sum(lengths)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    def target_step():
        return target.features(ids, layer_ids)

    feats = target_step()
    task = make_task(ids, loss_mask, cfg.objective, 0)

    def draft_step(features=None, optimizer=opt, block_task=None):
        block_task = block_task or task
        with autocast:
            out = draft_loss(drafter, block_task, feats if features is None else features, target.embed_weight,
                             head, use_flex, args.ce_chunk_size, mix, target.logits, compiled_loss=args.compile_loss,
                             ce_kernel=args.ce_kernel)
        (out.weighted_ce_sum / block_task.weights.sum()).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def overlapped(steps: int) -> None:
        """Draft step i on the default stream while target forward i+1 runs on a side stream."""
        side, main_stream = torch.cuda.Stream(), torch.cuda.current_stream()
        with torch.cuda.stream(side):
            ahead = target_step()
        for _ in range(steps):
            main_stream.wait_stream(side)
            current = ahead
            current.record_stream(main_stream)  # its memory is reused only after the draft step's kernels
            with torch.cuda.stream(side):
                ahead = target_step()
            draft_step(current)
        main_stream.wait_stream(side)

    warm = 2 if args.tiny else 3
    t_target = timed(target_step, device, args.steps, warm)
    progress(started, f"target forward: {tokens / t_target:,.0f} tokens/s")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_draft = timed(draft_step, device, args.steps, warm)
    progress(started, f"drafter step: {tokens / t_draft:,.0f} tokens/s")
    t_e2e = timed(lambda: draft_step(target_step()), device, args.steps, 1)
    progress(started, f"end to end: {tokens / t_e2e:,.0f} tokens/s")
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    syncs = host_syncs(lambda: draft_step(target_step()), device)
    profiles = {} if not args.profile else {  # --headline too: where the drafter step's time goes
        "profile_draft": profile_callable(draft_step, device),
        "profile_e2e": profile_callable(lambda: draft_step(target_step()), device),
        "profile_target": profile_callable(target_step, device)}
    levers = {} if args.headline else measure_levers(args, device, cfg, drafter, target_step, draft_step, overlapped,
                                                    ids, loss_mask, task, tokens)

    flops = step_flops(model, drafter, cfg, lengths, task, ids.shape[1])
    peak_tflops = matmul_tflops(device)
    counted = mfu_fields(flops, {"target": t_target, "drafter": t_draft, "e2e": t_e2e}, peak_tflops)
    harmonic = 1 / (1 / (tokens / t_target) + 1 / (tokens / t_draft))
    result = {
        "shape": shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "seq_tokens_per_step": tokens, "anchors": anchors, "block_size": 16,
        "family": args.family, "loss": args.loss, "ce_kernel": args.ce_kernel, "fp8_draft": args.fp8_draft, "fp8_target": args.fp8_target, "fp8_head": args.fp8_head, "compile_target": args.compile_target, "batch": args.batch, "steps_per_s": 1 / t_e2e, "drafter_steps_per_s": 1 / t_draft,
        "draft_layers": drafter.config.num_hidden_layers, "compile": args.compile, "compile_loss": args.compile_loss,
        "activation_checkpointing": args.activation_checkpointing,
        "target_tokens_per_s": tokens / t_target, "drafter_tokens_per_s": tokens / t_draft,
        "e2e_tokens_per_s": tokens / t_e2e, "harmonic_tokens_per_s": harmonic,
        "e2e_vs_harmonic": (tokens / t_e2e) / harmonic,
        "matmul_tflops": peak_tflops,
        **counted,
        "peak_memory_gib": peak,
        "host_syncs_per_step": None if syncs is None else len(syncs),
        "host_sync_sites": syncs,
        "first_sync_stack": first_sync(lambda: draft_step(target_step()), device),  # last: cuts a step short
        "full_length": args.full_length,
        **levers, **profiles,
        "e2e_overlap_mfu": levers.get("e2e_overlap_tokens_per_s") and mfu(counted["flops_per_step"], tokens / levers["e2e_overlap_tokens_per_s"],
                                                                           peak_tflops),
        "recompiles": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        "compile_settings": settings_for_manifest(),  # kernel tuning, set by a variable or a library, changes every rate
    }
    return write(result, args.out)


def write(result: dict, out: str | None) -> dict:
    print(json.dumps(result, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    return result


def recount(args, shape: str, max_length: int, anchors: int) -> dict:
    """`--recount`: the record's MFU from its measured rates and this file's count of its step's flops
    (the same batch and anchors: both come from seeded CPU generators), for records of an older count."""
    with open(args.recount) as f:
        record = json.load(f)
    model, _, cfg, drafter = build_models(args, shape, anchors, torch.device("meta"), torch.bfloat16)
    ids, loss_mask, lengths = make_batch(shape, args.batch, max_length, "cpu", torch.Generator().manual_seed(0),
                                         args.full_length)
    tokens = sum(lengths)
    if tokens != record["seq_tokens_per_step"] or anchors != record["anchors"]:
        raise SystemExit(f"{args.recount}: {record['seq_tokens_per_step']} tokens and {record['anchors']} anchors a "
                         f"step, this command's batch {tokens} and {anchors}: pass the flags of its run")
    flops = step_flops(model, drafter, cfg, lengths, make_task(ids, loss_mask, cfg.objective, 0), ids.shape[1])
    seconds = {part: tokens / record[f"{part}_tokens_per_s"] for part in ("target", "drafter", "e2e")}
    return {**record, **mfu_fields(flops, seconds, record["matmul_tflops"]),
            "mfu_recounted_from": {k: record.get(k) for k in ("target_mfu", "drafter_mfu", "e2e_mfu")}}


if __name__ == "__main__":
    main()
