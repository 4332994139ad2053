"""On CUDA: the static decoder's compiled steps, captured as CUDA graphs, decide exactly as its
eager twin and as the plain greedy decode in fp32; in bf16 the differences are reported (not
asserted: near-ties may flip).
Run: `python -m pytest tests/gpu -m gpu -s`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dflash_train.eval.served_speed import answer_differences
from dflash_train.decode.spec_decode import speculative_generate, target_greedy
from dflash_train.decode.static_decode import StaticDecoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eval.tiny_models import tiny_drafter, tiny_target  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _models(dtype):
    target = tiny_target(vocab_size=256, num_layers=4, hidden_size=64)
    drafter = tiny_drafter(target, block_size=8)
    target.model.config._attn_implementation = "sdpa"  # as load_target gives
    target.model.to("cuda", dtype)
    target.device = torch.device("cuda")
    target.__post_init__()  # embedding and head views of the moved weights
    return target, drafter.to("cuda", dtype)


def _prompts(vocab):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in (7, 30, 3, 12)]


@pytest.mark.parametrize("rows", [1, 4])
def test_graphs_decide_as_the_eager_path_in_fp32(rows):
    target, drafter = _models(torch.float32)
    prompts = _prompts(target.vocab_size)
    kwargs = dict(rows=rows, max_len=30 + 40, block_size=8)
    graphed = StaticDecoder(target, drafter, graphs=True, **kwargs)
    eager = StaticDecoder(target, drafter, graphs=False, **kwargs)
    assert graphed.steps.graphed, graphed.steps.graph_error
    assert graphed.steps.compiled == ["target", "draft", "verify", "advance"], graphed.steps.compile_error
    assert eager.steps.compiled == []
    for i in range(0, len(prompts), rows):
        group = prompts[i : i + rows]
        spec, ref = graphed.speculative(group, 40), eager.speculative(group, 40)
        base = graphed.greedy(group, 40)
        for p, s, r, b in zip(group, spec.results, ref.results, base.results):
            ids = torch.tensor([p], device="cuda")
            assert s.tokens == r.tokens == b.tokens == target_greedy(target, ids, 40).tokens
            assert s.acceptance_lengths == r.acceptance_lengths
            reference = speculative_generate(target, drafter, ids, 40, block_size=8)
            assert s.acceptance_lengths == reference.acceptance_lengths


def test_bf16_differences_are_reported():
    target, drafter = _models(torch.bfloat16)
    prompts = _prompts(target.vocab_size)
    decoder = StaticDecoder(target, drafter, rows=1, max_len=30 + 64, block_size=8)
    assert decoder.steps.graphed, decoder.steps.graph_error
    spec = [decoder.speculative([p], 64).results[0].tokens for p in prompts]
    base = [decoder.greedy([p], 64).results[0].tokens for p in prompts]
    report = answer_differences(target, prompts, spec, base)
    print(f"bf16: {report['differ']}/{report['answers']} answers differ, {report['near_ties']} at near ties:",
          report["first_differences"])
    assert report["answers"] == len(prompts)
