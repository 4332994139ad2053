"""Batched cache-free speculative decoding against the batch-1 cached decoder, prompt by prompt."""

import pytest
import torch
from tiny import tiny_target as sdpa_target

from dflash_train.draft.model import DFlashDraftModel
from dflash_train.eval.batched import batched_speculative
from dflash_train.eval.spec_decode import speculative_generate

from .tiny_models import tiny_drafter, tiny_target


def agreeing_target(eager: bool):
    """A target whose LM head favours one token, so drafts are often right: rounds of every length."""
    target = tiny_target() if eager else sdpa_target(vocab=256, initializer_range=0.1)
    with torch.no_grad():
        target.model.lm_head.weight[100] *= 8
    return target


def prompts(lengths, vocab=255, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("batch_size,block_size", [(3, 4), (8, 7), (1, 2)])
def test_every_row_decodes_as_it_would_alone(eager, batch_size, block_size):
    target = agreeing_target(eager)
    drafter = tiny_drafter(target, block_size=block_size)
    rows = prompts([1, 5, 12, 3, 7, 20])
    batched = batched_speculative(target, drafter, rows, 24, batch_size=batch_size)
    lengths = []
    for row, got in zip(rows, batched):
        alone = speculative_generate(target, drafter, torch.tensor([row]), 24)
        assert (got.tokens, got.acceptance_lengths, got.position_accepts) == (
            alone.tokens, alone.acceptance_lengths, alone.position_accepts)
        lengths += got.acceptance_lengths
    assert len(set(lengths)) >= min(3, block_size)  # rows out of step with each other: the point of the test


class RecordingDrafter(DFlashDraftModel):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.outputs = []

    def forward(self, *args, **kwargs):
        self.outputs.append(super().forward(*args, **kwargs))
        return self.outputs[-1]


@pytest.mark.parametrize("eager", [True, False])
def test_the_drafter_gets_the_same_inputs_as_alone(eager):
    """Tokens can agree while inputs differ (drafts that ignore the context); hidden states cannot:
    each row's drafter output in each round equals the batch-1 decoder's, whatever the padding."""
    target = agreeing_target(eager)
    drafter = RecordingDrafter(tiny_drafter(target, block_size=5).config).eval()
    drafter.load_state_dict(tiny_drafter(target, block_size=5).state_dict())
    rows = prompts([2, 11, 6, 17])
    batched = batched_speculative(target, drafter, rows, 20)
    per_round = drafter.outputs
    for i, row in enumerate(rows):
        drafter.outputs = []
        speculative_generate(target, drafter, torch.tensor([row]), 20)
        assert len(drafter.outputs) == len(batched[i].acceptance_lengths)
        for k, alone in enumerate(drafter.outputs):
            r = sum(len(batched[j].acceptance_lengths) > k for j in range(i))  # row i's place in round k
            torch.testing.assert_close(per_round[k][r], alone[0], rtol=1e-4, atol=1e-5)


def test_rows_stop_at_their_own_stop_token_or_budget():
    target = agreeing_target(eager=True)
    drafter = tiny_drafter(target, block_size=4)
    rows = prompts([4, 9, 6])
    free = batched_speculative(target, drafter, rows, 30)
    stop = free[1].tokens[7]  # row 1 stops early; other rows stop there too if they reach it
    stopped = batched_speculative(target, drafter, rows, 30, stop_ids=[stop])
    for row, got in zip(rows, stopped):
        assert got.tokens == speculative_generate(target, drafter, torch.tensor([row]), 30, stop_ids=[stop]).tokens
    assert len(stopped[1].tokens) <= 8 and stopped[1].tokens[-1] == stop
    assert max(len(r.tokens) for r in stopped) == 30


def test_rejects_empty_prompts():
    target = agreeing_target(eager=True)
    with pytest.raises(ValueError, match="at least one token"):
        batched_speculative(target, tiny_drafter(target), [[1, 2], []], 4)
