"""The draft length that pays: llama.cpp's tokens/s with the drafter at several `--spec-draft-n-max`
values, against the target alone, and the fastest lossless one.

On a CPU a verification of n tokens costs nearly n single steps, so a short draft pays there; on a
GPU the verification is nearly free and the drafter's own pass is what costs. At a length d below
the block's, llama.cpp runs the drafter over d + 1 tokens (the verified token and d masks), so its
proposals are not the full block's that eval measures: such a row's acceptance is llama.cpp's own,
never compared with ours. The block's full length is always measured, for that comparison.

A row's speed is the median over prompts of each prompt's tokens/s: on a shared machine another
process stalls llama.cpp's spinning threads for a few prompts at a time (2-4 tokens/s against
20-45 on 2 cores, 2026-12-06), which moves the total rate of a run by 2-5x and the median little.
The total over all prompts is kept beside it.

On CUDA, llama.cpp computes a several-token product of f32 weights on TF32 tensor cores (10-bit
mantissas: cuBLAS's TF32 math mode and its own mma kernels) and a one-token product in f32, so a
verification and a single step can round an answer apart where the target's two best tokens are
within rounding: such a first difference is a near-tie (eval/served_speed.py), shown and allowed.
On a CPU both compute alike in f32 and any difference fails.
"""

from __future__ import annotations

from statistics import median

from dflash_train.errors import UserError
from dflash_train.serve.llama_server import Completion


def parse_draft_lengths(text: str) -> tuple[int, ...]:
    """"3,7,15" -> (3, 7, 15); a ValueError in one line for anything else."""
    try:
        lengths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"draft lengths {text!r}: comma-separated whole numbers, e.g. 3,7,15") from None
    if any(length < 1 for length in lengths):
        raise ValueError(f"draft lengths {text!r}: each at least 1")
    return lengths


def draft_lengths_for(requested: tuple[int, ...] | None, block_size: int) -> list[int]:
    """The lengths measured, shortest first: the requested ones and the block's full length
    (block_size - 1, the only one our eval's acceptance is compared with)."""
    full = block_size - 1
    too_long = [length for length in requested or () if length > full]
    if too_long:
        raise UserError(f"--draft-lengths {','.join(map(str, requested))}: {too_long[0]} is more than the "
                        f"drafter's block of {block_size} drafts (at most {full})")
    return sorted(set(requested or ()) | {full})


def tokens_per_s(completions: list[Completion]) -> float:
    """Generated tokens over llama.cpp's own generation time, all prompts together."""
    seconds = sum(c.seconds for c in completions)
    return sum(len(c.tokens) for c in completions) / seconds if seconds > 0 else 0.0


def median_tokens_per_s(completions: list[Completion]) -> float:
    """The median over prompts of each prompt's tokens/s (llama.cpp's own generation time)."""
    rates = [len(c.tokens) / c.seconds for c in completions if c.seconds > 0]
    return median(rates) if rates else 0.0


def speed_row(draft_length: int, speculative: list[Completion], target_only: list[Completion],
              near_ties: int = 0) -> dict:
    """One draft length's figures: tokens/s (median prompt), llama.cpp's mean accepted length, the
    speedup over the target alone (median prompt against median prompt), how many answers equal
    the target's own, and how many others first leave it at a near-tie where one is allowed (CUDA)."""
    steps = sum(c.steps for c in speculative)
    accepted = sum(c.accepted for c in speculative)
    rate, base = median_tokens_per_s(speculative), median_tokens_per_s(target_only)
    mean_accepted = 1 + accepted / steps if steps else None
    speedup = rate / base if base > 0 else None
    return {
        "draft_length": draft_length,
        "tokens_per_s": rate,
        "tokens_per_s_all_prompts": tokens_per_s(speculative),
        "mean_accepted_length": mean_accepted,
        "verification_steps": steps, "accepted": accepted, "drafted": sum(c.drafted for c in speculative),
        "speedup": speedup,
        "round_cost_target_steps": round_cost(mean_accepted, speedup),
        **round_times(speculative),
        "lossless": {"matches": sum(s.tokens == b.tokens for s, b in zip(speculative, target_only)),
                     "total": len(target_only), "near_ties": near_ties},
    }


def round_times(speculative: list[Completion]) -> dict:
    """Where a round's time goes, in llama.cpp's own clocks over all prompts: the generation time per
    drafting round, and the part of it in the drafter's drafting pass (the rest: the target's
    verification, the drafter reading the verified tokens' features, sampling and the server's own
    work). Empty where llama.cpp's log did not give the drafter's time."""
    calls = sum(c.draft_calls for c in speculative)
    if not calls or any(c.draft_seconds is None for c in speculative):
        return {}
    return {"round_ms": 1000 * sum(c.seconds for c in speculative) / calls,
            "drafting_ms": 1000 * sum(c.draft_seconds for c in speculative) / calls}


def round_cost(mean_accepted_length: float | None, speedup: float | None) -> float | None:
    """A round's time in steps of the target alone (median prompts): the tokens it yields over the
    speedup. A draft length pays exactly where its mean accepted length exceeds this, so the figure
    says how far acceptance must rise, or the round's cost fall, before it does."""
    if mean_accepted_length is None or not speedup:
        return None
    return mean_accepted_length / speedup


def lossless_ok(row: dict) -> bool:
    """Every answer equals the target's own, or leaves it only at an allowed near-tie."""
    lossless = row["lossless"]
    return lossless["matches"] + lossless.get("near_ties", 0) == lossless["total"]


def best_row(rows: list[dict]) -> dict | None:
    """The fastest row (median prompt) whose every answer is lossless (None: no such row); a tie goes to
    the shorter."""
    lossless = [r for r in rows if lossless_ok(r)]
    return max(lossless, key=lambda r: (r["tokens_per_s"], -r["draft_length"]), default=None)


def format_rows(rows: list[dict], best: dict | None, target_only_rate: float) -> list[str]:
    """The per-length table and the best length, as serve-check prints them."""
    lines = [f"  {'draft length':>12}  {'tokens/s (median prompt)':>24}  {'mean accepted':>13}  {'speedup':>7}  "
             f"{'a round costs (target steps)':>28}  {'drafting ms / round ms':>22}  lossless",
             f"  {'target only':>12}  {target_only_rate:>24.1f}  {'':>13}  {'1.00x':>7}  {'1.00':>28}  {'':>22}"]
    for r in rows:
        tau = "n/a" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.3f}"
        speedup = "n/a" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        cost = round_cost(r["mean_accepted_length"], r["speedup"])
        cost = "n/a" if cost is None else f"{cost:.2f}"
        ties = r["lossless"].get("near_ties", 0)
        lossless = f"{r['lossless']['matches']}/{r['lossless']['total']}" + (f" +{ties} near-ties" if ties else "")
        split = f"{r['drafting_ms']:.2f} / {r['round_ms']:.2f}" if "round_ms" in r else "n/a"
        lines.append(f"  {r['draft_length']:>12}  {r['tokens_per_s']:>24.1f}  {tau:>13}  {speedup:>7}  {cost:>28}  "
                     f"{split:>22}  {lossless}")
    if best is None:
        lines.append("  best draft length: none (no length gave lossless answers)")
    else:
        tau = "n/a" if best["mean_accepted_length"] is None else f"{best['mean_accepted_length']:.3f}"
        speedup = "n/a" if best["speedup"] is None else f"{best['speedup']:.2f}x"
        lines.append(f"  best draft length: {best['draft_length']} (--spec-draft-n-max {best['draft_length']}): "
                     f"{best['tokens_per_s']:.1f} tokens/s, mean accepted length {tau}, {speedup} the target alone")
    return lines
