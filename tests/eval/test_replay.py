"""Greedy DFlash decoding replayed teacher-forced over the target's own greedy answer must give the
very rounds `speculative_generate` makes (the independent reference: real decoding with caches)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.eval.replay import replay_rounds, replayed_rounds
from dflash_train.decode.spec_decode import speculative_generate, target_greedy

from tests.decode.test_spec_decode import prompt
from .tiny_models import tiny_drafter, tiny_target


def test_rounds_by_hand():
    # anchor 0 accepts 2 drafts -> next anchor 3 accepts 0 -> anchor 4 accepts 5 -> anchor 10 ...
    prefixes = [2, 9, 9, 0, 5, 9, 9, 9, 9, 9, 3, 9, 9, 9, 9]
    assert replay_rounds(prefixes, new_tokens=20, answer_tokens=15) == [3, 1, 6, 4]  # the answer ends at 14
    assert replay_rounds(prefixes, new_tokens=6, answer_tokens=15) == [3, 1, 6]  # budget: verified drafts count
    assert replay_rounds(prefixes, new_tokens=1, answer_tokens=15) == []  # the prefill's token only
    assert replay_rounds([15] * 4, new_tokens=40, answer_tokens=4) == [4]  # none counted past the answer


VOCAB = 49152


@pytest.fixture(scope="module")
def peaked_target():
    target = tiny_target(vocab_size=VOCAB, num_layers=4)
    with torch.no_grad():  # one dominant LM-head row: target and drafter often pick it, not always
        target.model.lm_head.weight[100] *= 100
    return target


@pytest.mark.parametrize("block_size,new_tokens,seed", [(4, 40, 0), (3, 33, 2), (4, 25, 2)])
def test_replay_equals_speculative_decoding(peaked_target, block_size, new_tokens, seed):
    target = peaked_target
    drafter = tiny_drafter(target, block_size=block_size, layer_ids=(1, 3)).eval()
    ids = prompt(7, VOCAB, seed=seed)
    answer = target_greedy(target, ids, new_tokens + block_size).tokens  # held-out answers run past the budget
    row = torch.cat([ids[0], torch.tensor(answer)])
    loss_mask = torch.cat([torch.zeros(ids.shape[1], dtype=torch.long), torch.ones(len(answer), dtype=torch.long)])
    real = speculative_generate(target, drafter, ids, new_tokens)
    assert real.tokens == answer[:new_tokens]
    assert 1 < real.tau < block_size and min(real.acceptance_lengths) == 1  # a test that can fail both ways
    assert replayed_rounds(target, drafter, row, loss_mask, new_tokens) == real.acceptance_lengths
