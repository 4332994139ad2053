"""Targets with sliding-window layers (and gpt-oss's attention sinks) through the decode paths with
caches: the static decoder (greedy and speculative), the ragged cache of batched acceptance
decoding and `speculative_generate` on transformers' dynamic cache, against a plain cache-free
greedy loop and the decisions of the cache-free batched decode. Prompts and answers are longer
than the window (8): a path that masks it wrongly, or drops the sinks, drifts from the reference."""

import pytest
import torch
from tiny import tiny_windowed

from dflash_train.draft.model import DFlashDraftModel
from dflash_train.decode.batched import batched_speculative
from dflash_train.decode.ragged_cache import RaggedCache
from dflash_train.decode.spec_decode import speculative_generate
from dflash_train.decode.static_decode import StaticDecoder, static_cache_problem

from tests.decode.test_spec_decode import reference_greedy
from .tiny_models import tiny_drafter

FAMILIES = ["mistral", "gemma3", "gpt_oss"]
LENGTHS, NEW, BLOCK = [12, 20, 15], 24, 4
CUTS = [3, 0, 2, 1, 3, 0, 1, 2, 0]


class GuidedDrafter(DFlashDraftModel):
    """The real drafter's forward (its context cache filled as usual), pushed towards the greedy
    reference's next tokens in the first CUTS[start % 9] slots of a block, so rounds accept 1..B
    tokens. It knows a row only by its block's start and first token: the script is the same for
    every path, whatever the batch."""

    def __init__(self, cfg, target, references):
        super().__init__(cfg)
        self.lm_head, self.embed = target.lm_head_weight, target.embed_weight
        self.next = {(i, seq[i]): seq[i + 1:] for seq in references for i in range(len(seq) - 1)}

    def forward(self, context, block_embeds, ctx_positions, block_positions, mask=None, cache=None):
        hidden = super().forward(context, block_embeds, ctx_positions, block_positions, mask, cache)
        push = torch.zeros(*hidden.shape[:2], self.lm_head.shape[0])
        for r in range(hidden.shape[0]):
            start = int(block_positions[r, 0])
            first = int((self.embed == block_embeds[r, 0]).all(-1).nonzero()[0])
            for k, token in enumerate(self.next.get((start, first), [])[: CUTS[start % len(CUTS)]]):
                push[r, k + 1, token] = 50.0
        return hidden + torch.linalg.solve(self.lm_head, push.transpose(1, 2)).transpose(1, 2)  # logits + push


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    """A windowed target, prompts, their plain greedy answers and a drafter guided by them."""
    target = tiny_windowed(request.param)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    answers = [reference_greedy(target.model, torch.tensor([p]), NEW) for p in prompts]
    assert min(len(set(a)) for a in answers) > 5  # a random model that repeats one token proves nothing
    layer_ids = [0, target.num_layers - 1]
    drafter = GuidedDrafter(tiny_drafter(target, BLOCK, layer_ids).config, target,
                            [p + a for p, a in zip(prompts, answers)]).eval()
    drafter.load_state_dict(tiny_drafter(target, BLOCK, layer_ids).state_dict(), strict=False)
    return target, drafter, prompts, answers


@pytest.fixture(scope="module")
def cache_free(case):
    """The reference decisions: batched decoding that re-runs every row's whole sequence each round."""
    target, drafter, prompts, answers = case
    results = batched_speculative(target, drafter, prompts, NEW, cached=False)
    assert [r.tokens for r in results] == answers
    assert len({n for r in results for n in r.acceptance_lengths}) == BLOCK  # rounds of every length
    return results


def test_static_decoder_greedy_and_speculative(case, cache_free):
    target, drafter, prompts, answers = case
    assert static_cache_problem(target.model) is None
    decoder = StaticDecoder(target, drafter, rows=len(prompts), max_len=max(LENGTHS) + NEW)
    assert [r.tokens for r in decoder.greedy(prompts, NEW).results] == answers
    spec = decoder.speculative(prompts, NEW).results
    assert [r.tokens for r in spec] == answers
    assert [r.acceptance_lengths for r in spec] == [r.acceptance_lengths for r in cache_free]


def test_ragged_cache_batched_decode(case, cache_free):
    target, drafter, prompts, answers = case
    assert RaggedCache.supports(target) is None
    ragged = batched_speculative(target, drafter, prompts, NEW, cached=True)
    assert [r.tokens for r in ragged] == answers
    assert [(r.acceptance_lengths, r.position_accepts) for r in ragged] == [
        (r.acceptance_lengths, r.position_accepts) for r in cache_free]


def test_speculative_generate_crops_sliding_layers(case, cache_free):
    """One prompt at a time on transformers' dynamic cache: its sliding layers drop rejected K/V."""
    target, drafter, prompts, answers = case
    for p, reference in zip(prompts, cache_free):
        alone = speculative_generate(target, drafter, torch.tensor([p]), NEW)
        assert (alone.tokens, alone.acceptance_lengths) == (reference.tokens, reference.acceptance_lengths)
