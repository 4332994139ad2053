"""Real speculative-decoding evaluation: acceptance, losslessness, speed against the target alone.

Acceptance: every turn of every prompt is decoded speculatively, many prompts at a time
(batched_speculative); multi-turn prompts continue from the speculative answer, which is the
target's own answer (identical at temperature 0, a target sample above it). At temperature 0 each
answer is compared with transformers' greedy `generate`. Speed: the first turns of a few prompts
are decoded one at a time with KV caches, speculatively and by the target alone: by the static engine
(served_speed: static caches, CUDA graphs, as a server runs it) or the eager one (spec_decode:
transformers' dynamic cache, host-bound for small targets).
Outputs: a JSON report, a PNG (acceptance-length histogram, per-position acceptance), a table.
"""

from __future__ import annotations

import io
import json
import logging
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from dflash_train.atomic import write_atomic
from dflash_train.config import RunConfig
from dflash_train.config_training import EvalConfig
from dflash_train.disk import require_writable
from dflash_train.draft.model import DFlashDraftModel
from dflash_train.eval.export import load_drafter
from dflash_train.decode.greedy import generate_ids, pad_token_id
from dflash_train.decode.sampling import GenParams
from dflash_train.decode.batched import ACCEPTANCE_AUTO, ACCEPTANCE_ENGINES, batched_speculative
from dflash_train.decode.engines import choose
from dflash_train.eval.config import DecodeSettings, EvalJobConfig, prompt_sets
from dflash_train.eval.context_buckets import ContextTally
from dflash_train.data.generation_mode import served_thinking
from dflash_train.data.prompts import Prompt, load_prompts
from dflash_train.eval.served_speed import SPEED_ENGINES, difference_row, first_difference, speed_auto
from dflash_train.targets.model import Target, load_target, resolve_device, synced_time

log = logging.getLogger("dflash_train")


def stop_token_ids(target: Target) -> list[int]:
    """End-of-turn ids: the generation config's EOS (often a list), else the tokenizer's.

    The generation config wins: converted checkpoints can carry a wrong tokenizer EOS (the GGUF
    SmolLM2 says <|im_start|>, while the model ends turns with <|im_end|>).
    """
    eos = getattr(target.model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = target.tokenizer.eos_token_id
    return sorted(set(eos if isinstance(eos, list) else [eos]) - {None})  # none at all: decode to the budget


def encode(target: Target, messages: list[dict], thinking: bool | None = None) -> torch.Tensor:
    """The prompt as the target is served it: its chat template, in thinking mode `thinking` (None:
    the template's default)."""
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    text = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    ids = target.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    return ids.to(target.device)


MISMATCH_PROMPT_CHARS = 60
"""How much of a mismatched turn's question the report quotes: enough to find it in the set."""


def mismatch(target: Target, prompt_index: int, question: str, prompt_ids: list[int], answer: list[int],
             reference: list[int]) -> dict:
    """A speculative answer that is not the target's greedy one, named: the prompt (index, the start of
    its question), the first differing token (index, both ids and texts) and the target's top-2 logits
    after the shared prefix, which tell an fp32 near-tie from a broken decoder."""
    row = difference_row(target, prompt_ids, answer, reference)
    text = {key + "_text": target.tokenizer.decode([row[key]]) if row[key] is not None and target.tokenizer else None
            for key in ("token", "reference_token")}
    return {"prompt": prompt_index, "prompt_start": question[:MISMATCH_PROMPT_CHARS], **row, **text}


@torch.no_grad()
def decode_turns(
    target: Target, drafter: DFlashDraftModel, prompts: list[Prompt], max_new_tokens: int, temperature: float,
    block_size: int, generator: torch.Generator, batch_size: int, decode=batched_speculative,
    thinking: bool | None = None,
) -> dict:
    """Acceptance over every turn of `prompts`, `batch_size` rows at a time (batched_speculative);
    turn t of every prompt is asked after its answers to turns < t. At temperature 0 each answer is
    checked against transformers' own batched greedy `generate` (the lossless check). `decode`:
    batched_speculative or an acceptance engine's (batched.ACCEPTANCE_ENGINES)."""
    stop_ids = stop_token_ids(target)
    pad_id = pad_token_id(target.tokenizer, stop_ids)
    greedy = GenParams(temperature=0.0, top_p=1.0, max_tokens=max_new_tokens)
    answers: list[list[str]] = [[] for _ in prompts]
    turns: list[list[dict]] = [[] for _ in prompts]
    lengths, position_accepts, by_context = [], [0] * (block_size - 1), ContextTally()
    for t in range(max(len(p.turns) for p in prompts)):
        asked = [i for i, p in enumerate(prompts) if len(p.turns) > t]
        ids = [encode(target, prompts[i].messages(answers[i]), thinking)[0].tolist() for i in asked]
        specs = decode(target, drafter, ids, max_new_tokens, stop_ids, temperature, block_size, generator,
                       batch_size)
        references = [None] * len(ids)
        if temperature == 0:
            references = [new for i in range(0, len(ids), batch_size) for new, _ in
                          generate_ids(target.model, ids[i : i + batch_size], greedy, set(stop_ids), pad_id)]
        for i, prompt_ids, spec, reference in zip(asked, ids, specs, references):
            lengths += spec.acceptance_lengths
            by_context.add(len(prompt_ids), spec.acceptance_lengths)
            position_accepts = [a + b for a, b in zip(position_accepts, spec.position_accepts)]
            record = {"id": prompts[i].id, "turn": t, "prompt_tokens": len(prompt_ids), "new_tokens": len(spec.tokens),
                      "tau": round(spec.tau, 3), "lossless": None}
            if reference is not None:
                record["lossless"] = spec.tokens == reference
                if not record["lossless"]:
                    record["first_difference"] = first_difference(spec.tokens, reference)
                    record["mismatch"] = mismatch(target, i, prompts[i].turns[t], prompt_ids, spec.tokens, reference)
            turns[i].append(record)
            # the text as `generate` writes it (no space clean-up): the next turn's context
            answers[i].append(target.tokenizer.decode(spec.tokens, skip_special_tokens=True,
                                                      clean_up_tokenization_spaces=False))
        log.info("eval turn %d: %d prompts, tau %.2f so far", t + 1, len(asked), sum(lengths) / max(1, len(lengths)))
    return {"num_prompts": len(prompts), "lengths": lengths, "position_accepts": position_accepts,
            "tau_by_context": by_context.rows(), "turns": [r for rows in turns for r in rows]}


@torch.no_grad()
def measure_speed(target: Target, drafter: DFlashDraftModel, prompts: list[Prompt], settings: DecodeSettings,
                  block_size: int, generator: torch.Generator) -> dict:
    """Decode tokens/s of batch-1 speculative decoding and of the target alone, on the first turns of
    `prompts`, by the engine `settings.speed_engine` chooses (served_speed.SPEED_ENGINES)."""
    chosen = choose(SPEED_ENGINES, settings.speed_engine, speed_auto(target), target, settings.temperature,
                    "decode.speed_engine")
    ids = [encode(target, p.messages([]), settings.thinking)[0].tolist() for p in prompts]
    speed = chosen.engine.run(target, drafter, ids, settings.max_new_tokens, settings.temperature,
                              stop_token_ids(target), block_size, generator, settings.draft_p_min)
    return {"speed_engine": chosen.name, "static_unavailable": chosen.passed_over, **speed}


def summarize(decoded: dict, speed: dict, block_size: int, max_new_tokens: int, temperature: float) -> dict:
    """The report: acceptance from decode_turns, speed from measure_speed."""
    lengths, turns = decoded["lengths"], decoded["turns"]
    rounds = max(1, len(lengths))
    return {
        "num_prompts": decoded["num_prompts"],
        "num_turns": len(turns),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "block_size": block_size,
        "num_rounds": len(lengths),
        "tau": sum(lengths) / rounds,
        "acceptance_histogram": {str(k): lengths.count(k) for k in range(1, block_size + 1)},
        "position_acceptance": [a / rounds for a in decoded["position_accepts"]],
        "tau_by_context": decoded["tau_by_context"],
        **speed,
        "lossless": (
            {"matches": sum(t["lossless"] for t in turns), "total": len(turns)} if temperature == 0 else None
        ),
        "mismatches": [{"id": t["id"], "turn": t["turn"], **t["mismatch"]} for t in turns if "mismatch" in t],
        "turns": turns,
    }


# Why an FP8 target fails the lossless check whatever the eval's dtype: its 16-token verification and
# its 1-token greedy step round apart (docs/benchmarks/quality.md measured both granularities).
_FP8_NOT_LOSSLESS = {
    "tensorwise": "scales each activation tensor as a whole: the target's output for a token depends on the rest "
                  "of its batch",
    "rowwise": "quantises bfloat16 targets only, and in bfloat16 a 16-token verification and a 1-token greedy "
               "step round apart",
}


def evaluate(target: Target, drafter: DFlashDraftModel, prompts: list[Prompt],
             settings: DecodeSettings = DecodeSettings()) -> dict:
    """A report dict: acceptance over every turn of `prompts` (decode_turns), speed on the first
    turns of the first `settings.speed_prompts` of them (measure_speed; 0 skips it)."""
    if not prompts:
        raise ValueError("no prompts to evaluate")
    s = settings
    block_size = s.block_size or drafter.config.block_size
    generator = torch.Generator(device=target.device).manual_seed(s.seed)
    if target.fp8 != "off" and s.temperature == 0:
        log.warning("target.fp8=%s %s, and the lossless check will find differences",
                    target.fp8, _FP8_NOT_LOSSLESS[target.fp8])
    chosen = choose(ACCEPTANCE_ENGINES, s.acceptance_cache, ACCEPTANCE_AUTO, target, s.temperature,
                    "decode.acceptance_cache")
    t0 = synced_time(target.device)
    decoded = decode_turns(target, drafter, prompts, s.max_new_tokens, s.temperature, block_size, generator,
                           s.batch_size, partial(chosen.engine.run, draft_p_min=s.draft_p_min), s.thinking)
    acceptance = {"acceptance_cache": chosen.name,
                  "ragged_unavailable": ACCEPTANCE_ENGINES["ragged"].problem(target, s.temperature),
                  "acceptance_seconds": round(synced_time(target.device) - t0, 2)}
    speed = {"speed_prompts": 0, "spec_tokens_per_s": None, "target_tokens_per_s": None, "speedup": None}
    if s.speed_prompts:
        speed = measure_speed(target, drafter, prompts[: s.speed_prompts], s, block_size, generator)
    return {"target": target.name, "device": str(target.device), "target_dtype": str(target.embed_weight.dtype),
            "target_fp8": target.fp8, "thinking": s.thinking, **acceptance, **summarize(decoded, speed, block_size, s.max_new_tokens, s.temperature)}


def periodic_evaluator(prompts: str | list[Prompt], num_prompts: int | None, max_new_tokens: int,
                       thinking: bool | None = None):
    """For training: a function of the target and the drafter being trained giving real tau on
    held-out prompts (loaded once; a set name, a JSONL path, or the prompts themselves), asked in
    thinking mode `thinking`."""
    held_out = load_prompts(prompts, num_prompts) if isinstance(prompts, str) else prompts[:num_prompts]

    def run(target: Target, drafter: DFlashDraftModel) -> dict:
        # A few rows at a time: the run's target, drafter and optimizer stay resident meanwhile.
        report = evaluate(target, drafter, held_out,
                          DecodeSettings(max_new_tokens=max_new_tokens, batch_size=8, speed_prompts=0,
                                         thinking=thinking))
        keep = ("tau", "num_rounds", "position_acceptance", "lossless")
        return {k: report[k] for k in keep}

    return run


def check_periodic_eval(ec: EvalConfig) -> bool:
    """Whether `eval.every` is on; refused without `eval.prompts` (checked before anything loads)."""
    if ec.every and not ec.prompts:
        raise ValueError("eval.every is set but eval.prompts is not (mt-bench, humaneval, sharegpt, long or a JSONL)")
    return bool(ec.every)


def periodic_eval_for(cfg: RunConfig):
    """The evaluator for `eval.every` during training (`dflash-train train` and the lead rank of a
    colocated `launch`), in the thinking mode the run's data was rendered in; None when it is off."""
    if not check_periodic_eval(cfg.eval):
        return None
    return periodic_evaluator(cfg.eval.prompts, cfg.eval.num_prompts, cfg.eval.max_new_tokens,
                              served_thinking(cfg.data))


def format_table(report: dict) -> str:
    """The report's headline numbers as a rich table, rendered to a string for the terminal."""
    on = f" on {report['label']}" if "label" in report else ""
    fp8 = f", FP8 {report['target_fp8']}" if report.get("target_fp8", "off") != "off" else ""
    table = Table(title=f"DFlash eval: {report['target']}{on} ({report['num_turns']} turns, B={report['block_size']}, "
                        f"T={report['temperature']}{fp8})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("tau (accepted per round, incl. bonus)", f"{report['tau']:.2f}")
    table.add_row("rounds", str(report["num_rounds"]))
    if "acceptance_seconds" in report:
        table.add_row(f"acceptance + lossless decoding s ({report['acceptance_cache']} cache)",
                      f"{report['acceptance_seconds']:.1f}")
    if report["speedup"] is not None:
        on = f" ({report['speed_prompts']} prompts, batch 1, {report['speed_engine']} engine)"
        table.add_row("speculative decode tokens/s" + on, f"{report['spec_tokens_per_s']:.1f}")
        table.add_row("target-only decode tokens/s" + on, f"{report['target_tokens_per_s']:.1f}")
        table.add_row("speedup", f"{report['speedup']:.2f}x")
        if "ms_per_round" in report:  # the static engine's round split
            split = report["ms_per_round"]
            table.add_row("ms per round: draft / verify / rest", f"{split['draft']:.2f} / {split['verify']:.2f} / "
                                                                  f"{split['bookkeeping']:.2f}")
            table.add_row("steps compiled / CUDA graphs", f"{', '.join(report.get('compiled') or []) or 'none'} / "
                                                           f"{'yes' if report['graphs'] else 'no'}")
            diff = report["differences"]
            table.add_row("speed answers != target-only (near ties)", f"{diff['differ']} ({diff['near_ties']})")
    if report["lossless"] is not None:
        table.add_row("lossless (== target greedy)", f"{report['lossless']['matches']}/{report['lossless']['total']}")
    for m in report.get("mismatches", []):
        table.add_row(f"not lossless: prompt {m['prompt']} ({m['id']}, turn {m['turn'] + 1}) "
                      f"{m['prompt_start']!r}", describe_mismatch(m))
    rates = report["position_acceptance"]
    table.add_row("acceptance, positions 1-4", "  ".join(f"{r:.2f}" for r in rates[:4]))
    for row in report.get("tau_by_context", []):
        table.add_row(f"tau, context {row['context']} tokens", f"{row['tau']:.2f} ({row['rounds']} rounds)")
    out = io.StringIO()
    Console(file=out, width=100, force_terminal=False).print(table)
    return out.getvalue()


def describe_mismatch(m: dict) -> str:
    """One mismatch as the table shows it: the token index, ours against the target's, its top-2 logits."""
    if m.get("top2") is None:  # one answer stopped where the other went on
        return f"token {m['index']}: one answer ends there"
    logits = ", ".join(f"{tok} {value:.6f}" for tok, value in zip(m["top2"], m["top2_logits"]))
    return (f"token {m['index']}: {m['token']} {m['token_text']!r} != target's {m['reference_token']} "
            f"{m['reference_token_text']!r}; top-2 logits {logits} (gap {m['gap']:.2e}, relative "
            f"{m['relative_gap']:.1e})")


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


def run_eval(cfg: EvalJobConfig) -> list[dict]:
    """`dflash-train eval`: load target and drafter once, then per prompt set: its prompts, evaluate,
    write the report if `cfg.out` (`report_dirs`). One report per set, in order.

    target.dtype: the target's (and drafter's) compute dtype; float32 makes the lossless check exact
    where bf16 rounding can flip near-ties between a 16-token verification and a 1-token decode.
    """
    sets, dirs = prompt_sets(cfg.prompts), report_dirs(cfg)
    for out in filter(None, dirs):
        require_writable(out, "the eval report")
    chosen = [load_prompts(source, cfg.num_prompts) for _, source in sets]  # a bad set fails before loading
    dev = resolve_device(cfg.device)
    loaded = load_target(cfg.target, dev)
    drafter = load_drafter(cfg.drafter, loaded, dev)
    reports = []
    for (label, source), prompts, out in zip(sets, chosen, dirs):
        report = evaluate(loaded, drafter, prompts, cfg.decode)
        report.update(drafter=cfg.drafter, prompts=source, label=label)
        if out is not None:
            write_report(report, out)
        reports.append(report)
    return reports


def report_dirs(cfg: EvalJobConfig) -> list[Path | None]:
    """Where each set's report goes, one entry per set: `cfg.out` for one set, `cfg.out`/<label> for
    several; None without `cfg.out`."""
    sets = prompt_sets(cfg.prompts)
    if cfg.out is None:
        return [None] * len(sets)
    return [Path(cfg.out)] if len(sets) == 1 else [Path(cfg.out) / label for label, _ in sets]
