"""serve-check's verdict from its per-prompt results (no llama.cpp needed): on CUDA an answer that
leaves the target's own at a near-tie is allowed and compared apart; on a CPU, or away from a tie, it
fails."""

from __future__ import annotations

from pathlib import Path

from dflash_train.serve.check import PromptResult, ServeCheckSettings, counted_as_engine, summarize
from dflash_train.serve.llama_server import Completion

BLOCK, NEW = 4, 9


def _result(name: str, lengths: list[int], apart: dict | None = None) -> PromptResult:
    ours = list(range(NEW))
    steps, accepted = counted_as_engine(lengths, ours, set(), NEW, BLOCK)
    spec = ours if apart is None else ours[:3] + [99] * (NEW - 3)
    return PromptResult(id=name, prompt_tokens=5, ours=ours, ours_lengths=lengths,
                        target_only=Completion(tokens=ours, seconds=1.0),
                        speculative=Completion(tokens=spec, seconds=0.5, drafted=3 * steps, accepted=accepted,
                                               steps=steps),
                        difference=apart)


def _verdict(device: str, tie: bool) -> dict:
    settings = ServeCheckSettings(target="t", drafter="d", out=Path("."))
    apart = {"index": 3, "token": 99, "reference_token": 3, "gap": 0.004, "relative_gap": 2e-4, "near_tie": tie}
    results = [_result("a", [2, 2, 2, 2]), _result("b", [3, 3, 2]), _result("c", [2, 2, 2, 2], apart)]
    return summarize(results, settings, BLOCK, set(), device=device)


def test_on_cuda_a_near_tie_is_allowed_and_the_rounds_compare_over_the_alike_answers():
    s = _verdict("cuda", tie=True)
    assert s["lossless"] == {"matches": 2, "total": 3, "near_ties": 1}
    assert s["compared_prompts"] == 2 and s["same_steps_and_accepted"] == {"matches": 2, "total": 2}
    assert s["tau_gap"] == 0.0 and s["passed"]
    assert s["per_prompt"][2]["difference"]["near_tie"]


def test_a_difference_away_from_a_tie_or_on_a_cpu_fails():
    assert not _verdict("cuda", tie=False)["passed"]
    cpu = _verdict("cpu", tie=True)
    assert cpu["lossless"]["near_ties"] == 0 and cpu["compared_prompts"] == 3 and not cpu["passed"]
