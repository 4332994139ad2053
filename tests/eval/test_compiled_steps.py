"""The fixed-shape steps through torch.compile (inductor's C++ backend on CPU; graphs off): the
speculative decoder and the regeneration engine decide exactly as their plain twins in fp32, each
step compiles once into one graph, and the features a compiled verification reads (transformers'
output_hidden_states) are what Target.capture's hooks record."""

import pytest
import torch
from torch._dynamo.utils import counters

from dflash_train.decode.static_decode import StaticDecoder
from dflash_train.decode.graphed_engine import GraphedEngine, Job

from .tiny_models import tiny_drafter, tiny_target


@pytest.fixture
def fresh_counters():
    """Graph counts of this test alone. Inductor's options stay as they are: switching its vector
    ISA off for speed here was cached process-wide, and later compiles in the same worker failed
    (g++: "'at::vec' has not been declared")."""
    counters.clear()


def test_selected_hidden_states_are_the_captured_features():
    _check_selected_hidden_states()


def _check_selected_hidden_states():
    target = tiny_target(num_layers=3)
    layer_ids = [2, 0]  # 2 is the last layer: final-normed either way
    ids = torch.randint(0, target.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), target.capture(layer_ids) as store:
        out = target.model(input_ids=ids, output_hidden_states=target.hidden_state_indices(layer_ids))
    assert len(out.hidden_states) == 4  # the embeddings and 3 layers, the ones not selected None
    for i, index in zip(layer_ids, target.hidden_state_indices(layer_ids)):
        assert torch.equal(out.hidden_states[index], store[i])


@pytest.mark.slow(seconds=75)  # compiles five vectorised C++ graphs: ~40 s cold, seconds with inductor's cache warm
def test_compiled_steps_decide_as_the_plain_ones(fresh_counters):
    target = tiny_target(num_layers=1, vocab_size=12, seed=1)  # few tokens: random drafts get accepted
    drafter = tiny_drafter(target, block_size=4, layer_ids=(0,), num_layers=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 11, (n,), generator=gen).tolist() for n in (5, 11)]
    plain = StaticDecoder(target, drafter, rows=2, max_len=40, compile=False)
    fast = StaticDecoder(target, drafter, rows=2, max_len=40, compile=True)
    assert fast.steps.compiled == ["target", "draft", "verify", "advance"], fast.steps.compile_error
    assert plain.steps.compiled == [] and not fast.steps.graphed
    for decode in ("greedy", "speculative"):
        ref, got = getattr(plain, decode)(prompts, 24), getattr(fast, decode)(prompts, 24)
        for r, g in zip(ref.results, got.results):
            assert g.tokens == r.tokens
            assert getattr(g, "acceptance_lengths", None) == getattr(r, "acceptance_lengths", None)
    assert len({n for r in got.results for n in r.acceptance_lengths}) > 2  # blocks accept 1, 2, 3 tokens

    answers = []
    for compile in (False, True):
        engine = GraphedEngine(target.model, rows=2, stops=set(), pad_id=0, chunk=4, compile=compile)
        jobs = [Job(p, max_tokens=6 + 5 * i) for i, p in enumerate(prompts + prompts[::-1])]
        waiting = list(jobs)
        engine.serve(lambda n: [waiting.pop(0) for _ in range(min(n, len(waiting)))], lambda job: None)
        assert engine.steps.compiled == (["greedy"] if compile else []), engine.steps.compile_error
        answers.append([j.tokens for j in jobs])
    assert answers[0] == answers[1]
    # one graph per step, none recompiled on a later call, none broken into pieces
    assert counters["stats"]["unique_graphs"] == 5 and not counters["graph_break"]
    # an eager forward after the compiled flex-decoding step still gets the hidden states it selects
    # (transformers' output collector once stayed in its compile mode and kept them from it)
    _check_selected_hidden_states()
