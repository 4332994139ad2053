"""Batch-1 speed, speculative against the target alone, by the engine `decode.speed_engine` names
(SPEED_ENGINES): as served (the static decoder), or eager; and where the served answers part.

Both decoders run on the same StaticDecoder (same caches, graphs and host loop), so the speedup
compares like with like. In fp32 the answers are equal (tests); in bf16 a 16-token verification and
a 1-token step round differently, so an answer may flip at a near-tie. Each first difference is
checked against the target's own top-2 logit gap at that point, from one cache-free forward over
the shared prefix: `near_tie` when the gap is below NEAR_TIE_RELATIVE of the top logit (bf16 keeps
8 significant bits, a relative step of 0.4-0.8%, so 1e-2 is one or two rounding steps).
"""

from __future__ import annotations

import logging

import torch

from dflash_train.decode.engines import Engine
from dflash_train.decode.spec_decode import speculative_generate, target_greedy
from dflash_train.decode.static_decode import StaticDecoder, static_cache_problem
from dflash_train.draft.model import DFlashDraftModel
from dflash_train.targets.model import Target

log = logging.getLogger("dflash_train")

NEAR_TIE_RELATIVE = 1e-2


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix), None if equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@torch.no_grad()
def top2_gap(target: Target, ids: list[int]) -> dict:
    """The target's two best next tokens after `ids`, their logits and gap (absolute, relative to the top)."""
    logits = target.model(input_ids=torch.tensor([ids], device=target.device), use_cache=False,
                          logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2)
    gap = float(top.values[0] - top.values[1])
    return {"top2": top.indices.tolist(), "top2_logits": top.values.tolist(), "gap": gap,
            "relative_gap": gap / max(abs(float(top.values[0])), 1e-6)}


def difference_row(target: Target, prompt: list[int], answer: list[int], reference: list[int]) -> dict | None:
    """Where `answer` leaves `reference` (None: equal): the first differing index, both tokens, and the
    target's top-2 logits after the shared prefix, so a near-tie is shown, not assumed."""
    at = first_difference(answer, reference)
    if at is None:
        return None
    row = {"index": at, "token": answer[at] if at < len(answer) else None,
           "reference_token": reference[at] if at < len(reference) else None}
    if row["token"] is not None and row["reference_token"] is not None:  # else one stopped early: no tie to check
        row |= top2_gap(target, prompt + reference[:at])
        row["near_tie"] = row["relative_gap"] < NEAR_TIE_RELATIVE
    return row


def answer_differences(target: Target, prompts: list[list[int]], answers: list[list[int]],
                       references: list[list[int]]) -> dict:
    """How many answers differ from the references, and at each first difference the target's top-2 gap."""
    rows = []
    for i, (p, answer, ref) in enumerate(zip(prompts, answers, references)):
        row = difference_row(target, p, answer, ref)
        if row is not None:
            rows.append({"prompt": i, **row})
    return {"answers": len(answers), "differ": len(rows), "near_ties": sum(bool(r.get("near_tie")) for r in rows),
            "near_tie_relative_gap": NEAR_TIE_RELATIVE, "first_differences": rows}


def _mean_ms(seconds: list[float]) -> float:
    return round(1e3 * sum(seconds) / max(1, len(seconds)), 4)


def served_speed(target: Target, drafter: DFlashDraftModel, prompts: list[list[int]], max_new_tokens: int,
                 stop_ids=(), rows: int = 1, block_size: int | None = None, graphs: bool | None = None,
                 compile: bool | None = None) -> dict:
    """Decode tokens/s of speculative and target-only decoding of `prompts`, `rows` at a time, after a
    short untimed warm-up; tau, per-round time split, and the answers' differences. `graphs` and
    `compile` as StaticDecoder's."""
    decoder = StaticDecoder(target, drafter, rows, max(map(len, prompts)) + max_new_tokens, block_size, graphs,
                            compile)
    groups = [prompts[i : i + rows] for i in range(0, len(prompts), rows)]
    warm = min(8, max_new_tokens)
    decoder.speculative(groups[0], warm, stop_ids)
    decoder.greedy(groups[0], warm, stop_ids)
    spec = [decoder.speculative(g, max_new_tokens, stop_ids) for g in groups]
    base = [decoder.greedy(g, max_new_tokens, stop_ids) for g in groups]
    answers = [r.tokens for d in spec for r in d.results]
    references = [r.tokens for d in base for r in d.results]
    # The first token of each answer comes from the prefill in both decodes; the timed part is the rest.
    spec_rate = sum(len(a) - 1 for a in answers) / max(1e-9, sum(d.decode_seconds for d in spec))
    base_rate = sum(len(a) - 1 for a in references) / max(1e-9, sum(d.decode_seconds for d in base))
    lengths = [n for d in spec for r in d.results for n in r.acceptance_lengths]
    return {
        "rows": rows, "graphs": decoder.steps.graphed, "graph_error": decoder.steps.graph_error,
        "compiled": decoder.steps.compiled, "compile_error": decoder.steps.compile_error, "speed_prompts": len(prompts),
        "spec_tokens_per_s": spec_rate, "target_tokens_per_s": base_rate,
        "speedup": spec_rate / base_rate if base_rate > 0 else 0.0,
        "tau": sum(lengths) / max(1, len(lengths)),
        "ms_per_round": {"draft": _mean_ms([s for d in spec for s in d.draft_seconds]),
                         "verify": _mean_ms([s for d in spec for s in d.verify_seconds]),
                         "bookkeeping": _mean_ms([s for d in spec for s in d.bookkeeping_seconds])},
        "differences": answer_differences(target, prompts, answers, references),
    }


def static_speed(target: Target, drafter: DFlashDraftModel, prompts: list[list[int]], max_new_tokens: int,
                 temperature: float, stop_ids: list[int], block_size: int, generator, draft_p_min: float = 0.0) -> dict:
    """`served_speed` one row at a time; its tau is `speed_tau` (the report's tau is the acceptance set's)."""
    if draft_p_min > 0:
        raise ValueError("decode.draft_p_min: the static speed engine drafts whole blocks; set "
                         "decode.speed_engine=eager or decode.speed_prompts=0")
    served = served_speed(target, drafter, prompts, max_new_tokens, stop_ids, 1, block_size)
    served["speed_tau"] = served.pop("tau")
    return served


def _decode_rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def eager_speed(target: Target, drafter: DFlashDraftModel, prompts: list[list[int]], max_new_tokens: int,
                temperature: float, stop_ids: list[int], block_size: int, generator, draft_p_min: float = 0.0) -> dict:
    """Tokens/s of `speculative_generate` and `target_greedy` (transformers' dynamic cache: host-bound
    for small targets), one prompt at a time, after a short warm-up of both (kernels, allocator)."""
    ids = [torch.tensor([p], device=target.device) for p in prompts]
    speculative_generate(target, drafter, ids[0], 8, stop_ids, 0.0, block_size, generator)
    target_greedy(target, ids[0], 8, stop_ids)
    spec_tokens = spec_seconds = base_tokens = base_seconds = 0
    for prompt_ids in ids:
        spec = speculative_generate(target, drafter, prompt_ids, max_new_tokens, stop_ids, temperature, block_size,
                                    generator, draft_p_min)
        base = target_greedy(target, prompt_ids, max_new_tokens, stop_ids)
        # The first token comes from the prefill in both decodes; the timed part is the rest.
        spec_tokens, spec_seconds = spec_tokens + len(spec.tokens) - 1, spec_seconds + spec.decode_seconds
        base_tokens, base_seconds = base_tokens + len(base.tokens) - 1, base_seconds + base.decode_seconds
    spec_rate, base_rate = _decode_rate(spec_tokens, spec_seconds), _decode_rate(base_tokens, base_seconds)
    return {"speed_prompts": len(ids), "spec_tokens_per_s": spec_rate, "target_tokens_per_s": base_rate,
            "speedup": spec_rate / base_rate if base_rate > 0 else 0.0}


def _static_problem(target: Target, temperature: float) -> str | None:
    return "it decodes greedily only (temperature 0)" if temperature > 0 else static_cache_problem(target.model)


SPEED_ENGINES: dict[str, Engine] = {
    "static": Engine(static_speed, _static_problem, fallback="eager"),
    "eager": Engine(eager_speed),
}
"""How batch-1 speed is measured (`decode.speed_engine`): `static` as a server runs it (static caches,
CUDA graphs on a GPU), `eager` on transformers' dynamic cache. Each `run` is static_speed's signature."""


def speed_auto(target: Target) -> tuple[str, ...]:
    """`decode.speed_engine: auto`: static on a GPU (eager where it cannot run), eager on CPU, where
    nothing is captured and the static engine's fixed shapes only cost."""
    return ("static", "eager") if target.device.type == "cuda" else ("eager",)
