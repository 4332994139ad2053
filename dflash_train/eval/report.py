"""Real speculative-decoding evaluation: acceptance, speed against the target alone, losslessness.

Every turn of every prompt is decoded twice on the same context: speculatively, and by the target
alone (greedy, with its KV cache). Multi-turn prompts continue from the speculative answer, which
is the target's own answer (identical at temperature 0, a target sample above it).
Outputs: a JSON report, a PNG (acceptance-length histogram, per-position acceptance), a table.
"""

from __future__ import annotations

import functools
import io
import json
import logging
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dflash_train.atomic import write_atomic
from dflash_train.config import TargetConfig
from dflash_train.draft.model import DFlashDraftModel
from dflash_train.eval.export import load_drafter
from dflash_train.eval.prompts import Prompt, load_prompts
from dflash_train.eval.spec_decode import speculative_generate, target_greedy
from dflash_train.target import Target, load_target

log = logging.getLogger("dflash_train")


def stop_token_ids(target: Target) -> list[int]:
    """End-of-turn ids: the generation config's EOS (often a list), else the tokenizer's.

    The generation config wins: converted checkpoints can carry a wrong tokenizer EOS (the GGUF
    SmolLM2 says <|im_start|>, while the model ends turns with <|im_end|>).
    """
    eos = getattr(target.model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = target.tokenizer.eos_token_id
    return sorted(set(eos)) if isinstance(eos, list) else [eos]


def encode(target: Target, messages: list[dict]) -> torch.Tensor:
    text = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = target.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    return ids.to(target.device)


def _decode_rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def _warm_up(target: Target, drafter: DFlashDraftModel, prompt: Prompt, block_size: int, generator) -> None:
    """Kernels and allocator warmed on one short decode, so no prompt's timing carries start-up cost."""
    stop_ids = stop_token_ids(target)
    ids = encode(target, prompt.messages([]))
    speculative_generate(target, drafter, ids, 8, stop_ids, 0.0, block_size, generator)
    target_greedy(target, ids, 8, stop_ids)


@torch.no_grad()
def decode_prompts(
    target: Target, drafter: DFlashDraftModel, prompts: list[Prompt], max_new_tokens: int, temperature: float,
    block_size: int, generator: torch.Generator,
) -> dict:
    """Decode every turn of `prompts` speculatively and with the target alone: raw sums and, per
    prompt, its turn records (one process's share of an evaluation)."""
    stop_ids = stop_token_ids(target)
    part = {"target": target.name, "device": str(target.device), "block_size": block_size,
            "lengths": [], "position_accepts": [0] * (block_size - 1), "prompts": [],
            "spec_tokens": 0, "spec_seconds": 0.0, "base_tokens": 0, "base_seconds": 0.0}
    for prompt in prompts:
        answers: list[str] = []
        turns = []
        for t in range(len(prompt.turns)):
            ids = encode(target, prompt.messages(answers))
            spec = speculative_generate(target, drafter, ids, max_new_tokens, stop_ids, temperature, block_size, generator)
            base = target_greedy(target, ids, max_new_tokens, stop_ids)
            part["lengths"] += spec.acceptance_lengths
            part["position_accepts"] = [a + b for a, b in zip(part["position_accepts"], spec.position_accepts)]
            # The first token comes from the prefill in both decodes; the timed part is the rest.
            part["spec_tokens"] += len(spec.tokens) - 1
            part["spec_seconds"] += spec.decode_seconds
            part["base_tokens"] += len(base.tokens) - 1
            part["base_seconds"] += base.decode_seconds
            turns.append({
                "id": prompt.id, "turn": t, "prompt_tokens": ids.shape[1], "new_tokens": len(spec.tokens),
                "tau": round(spec.tau, 3), "lossless": spec.tokens == base.tokens if temperature == 0 else None,
            })
            answers.append(target.tokenizer.decode(spec.tokens, skip_special_tokens=True))
            log.info("eval %s turn %d: tau %.2f, %d tokens", prompt.id, t, spec.tau, len(spec.tokens))
        part["prompts"].append(turns)
    return part


def summarize(parts: list[dict], max_new_tokens: int, temperature: float) -> dict:
    """One report from the parts of an evaluation; parts[w] decoded prompts w, w+W, w+2W, ... (W parts)."""
    block_size = parts[0]["block_size"]
    lengths = [n for part in parts for n in part["lengths"]]
    position_accepts = [sum(col) for col in zip(*(part["position_accepts"] for part in parts))]
    per_prompt = [part["prompts"] for part in parts]
    num_prompts = sum(map(len, per_prompt))
    turns = [t for i in range(num_prompts) for t in per_prompt[i % len(parts)][i // len(parts)]]
    total = {k: sum(part[k] for part in parts) for k in ("spec_tokens", "spec_seconds", "base_tokens", "base_seconds")}
    spec_rate = _decode_rate(total["spec_tokens"], total["spec_seconds"])
    base_rate = _decode_rate(total["base_tokens"], total["base_seconds"])
    rounds = max(1, len(lengths))
    return {
        "target": parts[0]["target"],
        "device": parts[0]["device"],
        "workers": len(parts),
        "num_prompts": num_prompts,
        "num_turns": len(turns),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "block_size": block_size,
        "num_rounds": len(lengths),
        "tau": sum(lengths) / rounds,
        "acceptance_histogram": {str(k): lengths.count(k) for k in range(1, block_size + 1)},
        "position_acceptance": [a / rounds for a in position_accepts],
        "spec_tokens_per_s": spec_rate,
        "target_tokens_per_s": base_rate,
        "speedup": spec_rate / base_rate if base_rate > 0 else 0.0,
        "lossless": (
            {"matches": sum(t["lossless"] for t in turns), "total": len(turns)} if temperature == 0 else None
        ),
        "turns": turns,
    }


def _decode_share(
    target: Target, drafter: DFlashDraftModel, prompts: list[Prompt], max_new_tokens: int, temperature: float,
    block_size: int | None, seed: int,
) -> dict:
    """One process's share of an evaluation: warm up, then decode_prompts."""
    if not prompts:
        raise ValueError("no prompts to evaluate")
    block_size = block_size or drafter.config.block_size
    generator = torch.Generator(device=target.device).manual_seed(seed)
    _warm_up(target, drafter, prompts[0], block_size, generator)
    return decode_prompts(target, drafter, prompts, max_new_tokens, temperature, block_size, generator)


def evaluate(
    target: Target,
    drafter: DFlashDraftModel,
    prompts: list[Prompt],
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    block_size: int | None = None,
    seed: int = 0,
) -> dict:
    """Decode every turn speculatively and with the target alone, in this process; a report dict."""
    part = _decode_share(target, drafter, prompts, max_new_tokens, temperature, block_size, seed)
    return summarize([part], max_new_tokens, temperature)


def periodic_evaluator(prompts: str | list[Prompt], num_prompts: int | None, max_new_tokens: int):
    """For training: a function of the trainer giving real tau on held-out prompts (loaded once;
    a set name, a JSONL path, or the prompts themselves)."""
    held_out = load_prompts(prompts, num_prompts) if isinstance(prompts, str) else prompts[:num_prompts]

    def run(trainer) -> dict:
        report = evaluate(trainer.target, trainer.drafter, held_out, max_new_tokens)
        keep = ("tau", "num_rounds", "position_acceptance", "speedup", "lossless")
        return {k: report[k] for k in keep}

    return run


def format_table(report: dict) -> str:
    """The report's headline numbers as a rich table, rendered to a string for the terminal."""
    table = Table(title=f"DFlash eval: {report['target']} ({report['num_turns']} turns, B={report['block_size']}, "
                        f"T={report['temperature']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("tau (accepted per round, incl. bonus)", f"{report['tau']:.2f}")
    table.add_row("rounds", str(report["num_rounds"]))
    table.add_row("speculative decode tokens/s", f"{report['spec_tokens_per_s']:.1f}")
    table.add_row("target-only decode tokens/s", f"{report['target_tokens_per_s']:.1f}")
    shared = f" ({report['workers']} processes share the device)" if report.get("workers", 1) > 1 else ""
    table.add_row("speedup" + shared, f"{report['speedup']:.2f}x")
    if report["lossless"] is not None:
        table.add_row("lossless (== target greedy)", f"{report['lossless']['matches']}/{report['lossless']['total']}")
    rates = report["position_acceptance"]
    table.add_row("acceptance, positions 1-4", "  ".join(f"{r:.2f}" for r in rates[:4]))
    out = io.StringIO()
    Console(file=out, width=100, force_terminal=False).print(table)
    return out.getvalue()


def plot_report(report: dict, f) -> None:
    import matplotlib  # the optional `plot` extra: only needed when a report is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    hist = report["acceptance_histogram"]
    left.bar([int(k) for k in hist], list(hist.values()), color="tab:blue")
    left.set(title=f"acceptance length per round (tau {report['tau']:.2f})", xlabel="tokens per round", ylabel="rounds")
    rates = report["position_acceptance"]
    right.plot(range(1, len(rates) + 1), rates, marker="o", color="tab:green")
    right.set(title="proposal accepted, by block position", xlabel="position k", ylabel="rate", ylim=(0, 1.02))
    fig.tight_layout()
    fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def write_report(report: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """eval.json and eval.png in `out_dir`, each written atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "eval.json", out_dir / "eval.png"
    write_atomic(json_path, lambda f: f.write((json.dumps(report, indent=2) + "\n").encode()))
    write_atomic(png_path, lambda f: plot_report(report, f))
    return json_path, png_path


def _load_and_decode(
    target_cfg: TargetConfig, drafter_path: str, device: str, prompts: list[Prompt], max_new_tokens: int,
    temperature: float, block_size: int | None, seed: int,
) -> dict:
    dev = torch.device(device)
    target = load_target(target_cfg, dev)
    drafter = load_drafter(drafter_path, target, dev)
    return _decode_share(target, drafter, prompts, max_new_tokens, temperature, block_size, seed)


def _eval_worker(*share, threads: int) -> dict:
    """One evaluation process (spawned): its own target and drafter, its share of the prompts."""
    seed = share[-1]  # seed + worker index: names the worker in its log lines
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s eval worker {seed}: %(message)s")
    torch.set_num_threads(threads)
    return _load_and_decode(*share)


def run_eval(
    target: str,
    drafter: str,
    prompts: str = "mt-bench",
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    block_size: int | None = None,
    num_prompts: int | None = None,
    out: str | None = None,
    device: str = "auto",
    seed: int = 0,
    workers: int = 1,
    dtype: str = "auto",
) -> dict:
    """`dflash-train eval`: load target, drafter and prompts, evaluate, write the report if `out`.

    workers > 1 runs that many processes on the same device, each with its own models and every
    workers-th prompt: batch-1 decoding of a small target leaves a GPU mostly idle, waiting on the
    host. Their decode timings then share the device, so take speedup from a workers=1 run.
    dtype: the target's (and drafter's) compute dtype; float32 makes the lossless check exact where
    bf16 rounding can flip near-ties between a 16-token verification and a 1-token decode.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if block_size is not None and block_size < 2:
        raise ValueError(f"block size must be >= 2 (one verified token + proposals), got {block_size}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    target_cfg = TargetConfig(path=target, dtype=dtype)
    chosen = load_prompts(prompts, num_prompts)
    workers = max(1, min(workers, len(chosen)))
    shares = [(target_cfg, str(drafter), device, chosen[w::workers], max_new_tokens, temperature, block_size, seed + w)
              for w in range(workers)]
    if workers == 1:
        parts = [_load_and_decode(*shares[0])]
    else:
        threads = max(1, torch.get_num_threads() // workers)
        context = torch.multiprocessing.get_context("spawn")  # CUDA cannot be used in forked children
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            parts = list(pool.map(functools.partial(_eval_worker, threads=threads), *zip(*shares)))
    report = summarize(parts, max_new_tokens, temperature)
    report.update(drafter=str(drafter), prompts=prompts)
    if out is not None:
        write_report(report, out)
    return report
