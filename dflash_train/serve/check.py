"""`dflash-train serve-check`: does a serving engine run the drafter as our eval measures it?

1. Our side: the target and drafter in float32 decode each prompt greedily with speculative decoding,
   as `eval` measures acceptance (decode/batched.py), giving each answer and its rounds.
2. The engine's side: the target and the drafter's export converted to GGUF with llama.cpp's own
   converter, then llama-server decodes the same token prompts greedily, once with the target alone
   and once with the drafter (its family's `--spec-type`: draft-dflash, or draft-dspark for DSpark).
3. The table: lossless (every speculative answer equal to the engine's target-only answer), the
   engine's mean accepted length against our tau on the same prompts, tokens/s with and without
   the drafter at each requested draft length (draft_lengths.py), and the fastest lossless one;
   beside it, our static decoder's speedup on the same prompts and device (eval/served_speed.py:
   batch 1, the target in float32 on a CPU as the f32 GGUF, in bfloat16 on a GPU as served).
   The check fails (exit 1) when an answer differs at any length, the acceptance gap exceeds
   `max_tau_gap`, or (f32, where both compute alike) fewer than `min_identical` of the prompts agree
   round for round. Each differing answer is shown with our target's top-2 logits where it first
   differs; on CUDA one that differs at a near-tie is allowed (draft_lengths.py says why), and the
   acceptance compares over the prompts both sides answer alike.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_train.atomic import write_json_atomic
from dflash_train.config_model import TargetConfig
from dflash_train.data.prompts import Prompt, load_prompts
from dflash_train.eval.export import CHECKPOINT_CONFIG, export_drafter, load_drafter, read_drafter_config
from dflash_train.eval.report import encode, stop_token_ids
from dflash_train.eval.served_speed import difference_row, first_difference, served_speed
from dflash_train.decode.batched import batched_speculative
from dflash_train.decode.spec_decode import SpecResult
from dflash_train.families import family
from dflash_train.serve.draft_lengths import (best_row, draft_lengths_for, format_rows, lossless_ok,
                                              median_tokens_per_s, speed_row, tokens_per_s)
from dflash_train.serve.gguf import convert
from dflash_train.serve.llama_cpp import LlamaCpp
from dflash_train.serve.llama_server import Completion, LlamaServer
from dflash_train.targets.model import load_target
from dflash_train.targets.tokenizer import resolve_target_path

log = logging.getLogger("dflash_train")


@dataclass
class ServeCheckSettings:
    target: str
    drafter: str
    """What our eval decodes: a training checkpoint or an export folder."""
    out: Path
    export: str | None = None
    """What llama.cpp serves: an export folder; default: `drafter` (exported into `out` first when it
    is a checkpoint). Naming both checks an export against the checkpoint it was made from."""
    prompts: str = "mt-bench"
    num_prompts: int = 20
    max_new_tokens: int = 128
    gguf_type: str = "f32"
    """f32: the same numerics as our float32 eval, so answers and acceptance can be compared exactly."""
    max_tau_gap: float = 0.03
    """Largest allowed |engine mean length / our tau - 1|."""
    min_identical: float = 0.9
    """f32 only: the smallest share of prompts whose verification steps and accepted drafts are ours
    exactly. Computing alike, the two decoders agree round for round; a drafter this weak barely
    moves the mean when an export is broken, while its rounds stop agreeing."""
    threads: int | None = None
    draft_lengths: tuple[int, ...] | None = None
    """llama.cpp's --spec-draft-n-max values measured (draft_lengths.py); the block's full length
    always among them. Default: that one only."""
    draft_p_min: float = 0.0
    """llama.cpp's --spec-draft-p-min, our decode's draft_p_min alike: a draft stops at its first slot of
    confidence below it (DSpark's confidence head, DFlash2's selector; DFlash has none). 0: off."""
    backend_sampling: bool = False
    """llama.cpp's -bs: the target's greedy pick made on the device, so a verification copies no logits
    to the host; the choice does not change an answer."""
    our_speed: bool = True
    """Our static decoder's speed on the same prompts and device beside the engine's (`our_speed`)."""


@dataclass
class PromptResult:
    id: str
    prompt_tokens: int
    ours: list[int]
    ours_lengths: list[int]
    target_only: Completion
    speculative: Completion
    ours_drafted: list[int] | None = None
    """Each round's proposals where a confidence threshold cut them (None: every round the full block)."""
    checks: dict = field(default_factory=dict)
    difference: dict | None = None
    """Where the speculative answer first leaves the target-only one, with our float32 target's top-2
    logits there (eval/served_speed.difference_row); None when equal."""


def _export_dir(settings: ServeCheckSettings) -> Path:
    """The folder llama.cpp serves: the given export, or a fresh export of a training checkpoint."""
    path = Path(settings.export or settings.drafter)
    if (path / "config.json").is_file() and not (path / CHECKPOINT_CONFIG).is_file():
        return path
    if settings.export is not None:
        raise FileNotFoundError(f"--export {settings.export}: not an export folder (no config.json, or a checkpoint)")
    return export_drafter(path, settings.out / "export", target=settings.target)


def our_decodes(settings: ServeCheckSettings,
                prompts: list[Prompt]) -> tuple[list[list[int]], list[SpecResult], set[int]]:
    """(prompt ids, our float32 speculative decode, stop ids) of every prompt's first turn, decoded as `eval`
    decodes for acceptance (batched_speculative); the target is freed after, before llama.cpp loads
    its own copy."""
    target = load_target(TargetConfig(path=settings.target, dtype="float32"), torch.device("cpu"))
    drafter = load_drafter(settings.drafter, target, torch.device("cpu"))
    for weight in drafter.parameters():  # the weights as the export stores them, then computed in float32
        weight.data = weight.data.to(torch.bfloat16).to(torch.float32)
    prompt_ids = [encode(target, p.messages([]))[0].tolist() for p in prompts]
    stop_ids = stop_token_ids(target)
    decodes = batched_speculative(target, drafter, prompt_ids, settings.max_new_tokens, stop_ids,
                                  draft_p_min=settings.draft_p_min)
    return prompt_ids, decodes, set(stop_ids)


def our_speed(settings: ServeCheckSettings, prompt_ids: list[list[int]], stop_ids: set[int], cuda: bool) -> dict:
    """Our static decoder's tokens/s with and without the drafter on the same prompts, one at a time, on
    the engine's device (what `eval` reports as served); {"error": why} where it cannot run."""
    if settings.draft_p_min > 0:
        return {"error": "the static decoder drafts whole blocks (no --draft-p-min)"}
    device = torch.device("cuda" if cuda else "cpu")
    target = load_target(TargetConfig(path=settings.target, dtype="bfloat16" if cuda else "float32"), device)
    drafter = load_drafter(settings.drafter, target, device)
    try:
        speed = served_speed(target, drafter, prompt_ids, settings.max_new_tokens, sorted(stop_ids))
    except ValueError as e:  # a target the static caches cannot hold (static_cache_problem)
        return {"error": str(e)}
    keep = ("spec_tokens_per_s", "target_tokens_per_s", "speedup", "tau", "ms_per_round", "graphs", "compiled")
    return {"device": device.type, "dtype": str(target.embed_weight.dtype).removeprefix("torch."),
            **{k: speed[k] for k in keep}, "answers_differ": speed["differences"]["differ"]}


def counted_as_engine(lengths: list[int], answer: list[int], stop_ids: set[int], max_new_tokens: int,
                      block_size: int, drafted: list[int] | None = None) -> tuple[int, int]:
    """(verification steps, accepted drafts) of our rounds counted as llama.cpp counts them: it drafts
    at most `remaining - 1` tokens so a round never passes the budget (the drafter still runs the full
    block, so the proposals are ours), decodes the last token without a draft, and accepts no draft
    past a stop token unless it is the round's last (common/sampling.cpp). `drafted`: each round's
    proposals where a confidence threshold cut them; a round that drafted none is a plain target step."""
    generated, steps, accepted = 1, 0, 0  # the prefill's token
    for r, length in enumerate(lengths):
        drafts = min(block_size - 1, max_new_tokens - generated - 1)
        if drafts <= 0:
            break
        if drafted is not None and drafted[r] == 0:
            generated += 1
            continue
        drafts = drafts if drafted is None else min(drafts, drafted[r])
        taken = min(length - 1, drafts)
        stop = next((j for j in range(taken) if generated + j < len(answer) and answer[generated + j] in stop_ids),
                    None)
        if stop is not None and stop + 1 < drafts:
            taken = stop  # the stop token comes from the target instead, as the round's own token
        steps, accepted, generated = steps + 1, accepted + taken, generated + taken + 1
    return steps, accepted


def answer_differences(settings: ServeCheckSettings, prompt_ids: list[list[int]], target_only: list[Completion],
                       by_length: dict[int, list[Completion]]) -> dict[int, list[dict | None]]:
    """Per draft length, per prompt: where the speculative answer first leaves the engine's target-only
    one, and our float32 target's top-2 logits after the shared prefix (None where equal); the target
    loads only when some answer differs."""
    apart = {n: [s.tokens != b.tokens for s, b in zip(answers, target_only)] for n, answers in by_length.items()}
    if not any(any(flags) for flags in apart.values()):
        return {n: [None] * len(target_only) for n in by_length}
    target = load_target(TargetConfig(path=settings.target, dtype="float32"), torch.device("cpu"))
    return {n: [difference_row(target, ids, s.tokens, b.tokens) if differs else None
                for ids, s, b, differs in zip(prompt_ids, answers, target_only, apart[n])]
            for n, answers in by_length.items()}


def near_ties(differences: list[dict | None]) -> int:
    return sum(bool(d and d.get("near_tie")) for d in differences)


def _engine_answers(llama: LlamaCpp, target_gguf: Path, drafter_gguf: Path | None, block_size: int,
                    prompt_ids: list[list[int]], settings: ServeCheckSettings, log_name: str,
                    draft_length: int | None = None, spec_type: str = "draft-dflash") -> list[Completion]:
    with LlamaServer(llama, target_gguf, drafter_gguf, block_size, settings.out / log_name,
                     threads=settings.threads, exact=settings.gguf_type == "f32",
                     draft_length=draft_length, spec_type=spec_type, draft_p_min=settings.draft_p_min,
                     backend_sampling=settings.backend_sampling) as server:
        warm_up = server.complete(prompt_ids[0], 8)  # the first request pays one-time set-up
        answers = [server.complete(ids, settings.max_new_tokens) for ids in prompt_ids]
    if drafter_gguf is not None:
        server.time_drafting([warm_up, *answers])
    return answers


def summarize(results: list[PromptResult], settings: ServeCheckSettings, block_size: int, stop_ids: set[int],
              rows: list[dict] | None = None, device: str = "cpu") -> dict:
    """The table's figures; the comparison with ours is at the block's full length (`results`), and
    `rows` (draft_lengths.speed_row, one per measured length) add the speed at each length."""
    rounds = sum(len(r.ours_lengths) for r in results)
    ours_tau = sum(sum(r.ours_lengths) for r in results) / max(1, rounds)
    counted = [counted_as_engine(r.ours_lengths, r.ours, stop_ids, settings.max_new_tokens, block_size, r.ours_drafted)
               for r in results]
    lossless = sum(r.speculative.tokens == r.target_only.tokens for r in results)
    ties = near_ties([r.difference for r in results]) if device == "cuda" else 0
    # rounds compare where both sides decode the same answer: on CUDA a near-tie sends one elsewhere
    same = [(r, c) for r, c in zip(results, counted) if device != "cuda" or r.speculative.tokens == r.ours]
    our_steps, our_accepted = sum(c[0] for _, c in same), sum(c[1] for _, c in same)
    ours_as_engine = 1 + our_accepted / our_steps if our_steps else None
    steps = sum(r.speculative.steps for r, _ in same)
    engine_tau = 1 + sum(r.speculative.accepted for r, _ in same) / steps if steps else None
    gap = None if engine_tau is None or ours_as_engine is None else engine_tau / ours_as_engine - 1
    same_rounds = sum((r.speculative.steps, r.speculative.accepted) == c for r, c in same)
    same_as_ours = sum(r.target_only.tokens == r.ours for r in results)
    target_only = [r.target_only for r in results]
    spec_rate, base_rate = tokens_per_s([r.speculative for r in results]), tokens_per_s(target_only)
    rows = rows or [speed_row(block_size - 1, [r.speculative for r in results], target_only, ties)]
    exact = settings.gguf_type == "f32"
    identical_ok = not exact or same_rounds >= settings.min_identical * len(same)
    every_length_lossless = all(lossless_ok(row) for row in rows)
    passed = (lossless + ties == len(results) and every_length_lossless and gap is not None
              and abs(gap) <= settings.max_tau_gap and identical_ok)
    return {
        "engine": "llama.cpp", "device": device, "target": settings.target, "drafter": settings.drafter,
        "export": settings.export, "prompts": settings.prompts,
        "num_prompts": len(results), "max_new_tokens": settings.max_new_tokens, "gguf_type": settings.gguf_type,
        "backend_sampling": settings.backend_sampling, "block_size": block_size,
        "lossless": {"matches": lossless, "total": len(results), "near_ties": ties},
        "same_answer_as_ours": {"matches": same_as_ours, "total": len(results)},
        "engine_mean_accepted_length": engine_tau, "engine_verification_steps": steps,
        "engine_drafted": sum(r.speculative.drafted for r, _ in same),
        "engine_accepted": sum(r.speculative.accepted for r, _ in same),
        "compared_prompts": len(same),
        "our_tau": ours_tau, "our_rounds": rounds, "our_tau_counted_as_engine": ours_as_engine,
        "our_steps_counted_as_engine": our_steps, "our_accepted": our_accepted,
        "same_steps_and_accepted": {"matches": same_rounds, "total": len(same)},
        "min_identical": settings.min_identical if exact else None,
        "tau_gap": gap, "max_tau_gap": settings.max_tau_gap,
        "engine_tokens_per_s": {"with_drafter": spec_rate, "target_only": base_rate},
        "engine_speedup": spec_rate / base_rate if base_rate > 0 else None,
        "target_only_median_prompt_tokens_per_s": median_tokens_per_s(target_only),
        "draft_lengths": rows, "best_draft_length": best_row(rows),
        "passed": passed,
        "per_prompt": [{"id": r.id, "prompt_tokens": r.prompt_tokens,
                        "engine_steps": r.speculative.steps, "engine_accepted": r.speculative.accepted,
                        "our_steps_counted_as_engine": c[0], "our_accepted_counted_as_engine": c[1],
                        "our_tau": sum(r.ours_lengths) / max(1, len(r.ours_lengths)),
                        "lossless": r.speculative.tokens == r.target_only.tokens,
                        "first_difference": first_difference(r.speculative.tokens, r.target_only.tokens),
                        "difference": r.difference,
                        "same_answer_as_ours": r.target_only.tokens == r.ours}
                       for r, c in zip(results, counted)],
    }


def format_summary(s: dict) -> str:
    def ratio(d):
        return f"{d['matches']}/{d['total']}"

    engine_tau = s["engine_mean_accepted_length"]
    rows = [
        ("lossless (speculative == target-only answer)", ratio(s["lossless"]) +
         (f" +{s['lossless']['near_ties']} apart at near-ties (CUDA's TF32 verification)"
          if s["lossless"].get("near_ties") else "")),
        ("llama.cpp target answer == dflash-train's", ratio(s["same_answer_as_ours"])),
        ("llama.cpp mean accepted length", "n/a" if engine_tau is None else f"{engine_tau:.3f} "
         f"({s['engine_accepted']} accepted in {s['engine_verification_steps']} steps)"),
        ("dflash-train, counted as llama.cpp counts", "n/a" if s["our_tau_counted_as_engine"] is None else
         f"{s['our_tau_counted_as_engine']:.3f} "
         f"({s['our_accepted']} accepted in {s['our_steps_counted_as_engine']} steps)"),
        ("prompts with the same steps and accepted", ratio(s["same_steps_and_accepted"]) +
         ("" if s["min_identical"] is None else f" (at least {100 * s['min_identical']:.0f}% needed)")),
        ("dflash-train eval tau (fp32)", f"{s['our_tau']:.3f} ({s['our_rounds']} rounds, the budget's last round "
         "counted whole)"),
        ("gap", "n/a" if s["tau_gap"] is None else
         f"{100 * s['tau_gap']:+.1f}% (allowed {100 * s['max_tau_gap']:.0f}%)"),
        ("llama.cpp tokens/s with drafter", f"{s['engine_tokens_per_s']['with_drafter']:.1f}"),
        ("llama.cpp tokens/s target only", f"{s['engine_tokens_per_s']['target_only']:.1f}"),
        ("speedup", "n/a" if s["engine_speedup"] is None else f"{s['engine_speedup']:.2f}x"),
    ]
    ours = s.get("our_static_decoder")
    if ours:
        rows.append(("dflash-train's static decoder, same prompts", ours["error"] if "error" in ours else
                     f"{ours['speedup']:.2f}x ({ours['spec_tokens_per_s']:.1f} / {ours['target_tokens_per_s']:.1f} "
                     f"tokens/s, {ours['device']} {ours['dtype']}, batch 1)"))
    width = max(len(k) for k, _ in rows)
    head = (f"serve-check: llama.cpp on {s['device']}, {s['num_prompts']} {s['prompts']} prompts, "
            f"{s['max_new_tokens']} new tokens, greedy, {s['gguf_type']} GGUF"
            f"{', backend sampling' if s.get('backend_sampling') else ''}; drafting {s['block_size'] - 1} "
            f"(the full block) unless a row says otherwise")
    lines = [head] + [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += format_rows(s["draft_lengths"], s["best_draft_length"], s["target_only_median_prompt_tokens_per_s"])
    lines.append("PASSED" if s["passed"] else "FAILED")
    return "\n".join(lines)


def serve_check(llama: LlamaCpp, settings: ServeCheckSettings) -> dict:
    """Run the check; writes serve_check.json, the GGUFs and the server logs into `settings.out`."""
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    cfg = read_drafter_config(settings.drafter)  # before anything loads; our_decodes reads the weights
    lengths = draft_lengths_for(settings.draft_lengths, cfg.block_size)
    target_dir = Path(resolve_target_path(settings.target))
    prompts = load_prompts(settings.prompts, settings.num_prompts)
    t0 = time.monotonic()
    log.info("serve-check: our float32 speculative decode of %d prompts", len(prompts))
    prompt_ids, ours, stop_ids = our_decodes(settings, prompts)
    export = _export_dir(settings)
    log.info("serve-check: converting target and drafter to %s GGUF with %s", settings.gguf_type, llama.converter)
    target_gguf = convert(llama, target_dir, out / f"target-{settings.gguf_type}.gguf", settings.gguf_type,
                          out / "convert_target.log")
    drafter_gguf = convert(llama, export, out / f"drafter-{settings.gguf_type}.gguf", settings.gguf_type,
                           out / "convert_drafter.log", target_dir=target_dir)
    log.info("serve-check: llama-server, target alone")
    base = _engine_answers(llama, target_gguf, None, cfg.block_size, prompt_ids, settings, "server_target.log")
    by_length = {}
    for length in lengths:
        log.info("serve-check: llama-server with the drafter, drafting %d", length)
        name = "server_drafter.log" if length == cfg.block_size - 1 else f"server_drafter_n{length}.log"
        by_length[length] = _engine_answers(llama, target_gguf, drafter_gguf, cfg.block_size, prompt_ids, settings,
                                            name, draft_length=length, spec_type=family(cfg.family).spec_type)
    spec = by_length[cfg.block_size - 1]
    differences = answer_differences(settings, prompt_ids, base, by_length)
    results = [PromptResult(id=p.id, prompt_tokens=len(ids), ours=o.tokens, ours_lengths=o.acceptance_lengths,
                            ours_drafted=o.draft_lengths,
                            target_only=b, speculative=s, difference=d)
               for p, ids, o, b, s, d in zip(prompts, prompt_ids, ours, base, spec, differences[cfg.block_size - 1])]
    rows = [speed_row(length, answers, base, near_ties(differences[length]) if llama.cuda else 0)
            for length, answers in by_length.items()]
    summary = summarize(results, settings, cfg.block_size, stop_ids, rows, "cuda" if llama.cuda else "cpu")
    if settings.our_speed:
        log.info("serve-check: our static decoder on the same prompts, with and without the drafter")
        summary["our_static_decoder"] = our_speed(settings, prompt_ids, stop_ids, llama.cuda)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    write_json_atomic(out / "serve_check.json", summary)
    return summary

