"""Batched speculative decoding, through the ragged KV cache and cache-free, against the batch-1
cached decoder, prompt by prompt; the ragged cache's layout against a fresh prefill of each row."""

import pytest
import torch
from tiny import tiny_target as sdpa_target

from dflash_train.draft.model import DFlashDraftModel
from transformers import DynamicCache

from dflash_train.decode.batched import _right_padded, batched_speculative
from dflash_train.decode.ragged_cache import RaggedCache, RaggedDraftCache
from dflash_train.decode.spec_decode import speculative_generate

from tests.eval.tiny_models import tiny_drafter, tiny_target


def agreeing_target(eager: bool):
    """A target whose LM head favours one token, so drafts are often right: rounds of every length."""
    target = tiny_target() if eager else sdpa_target(vocab=256, initializer_range=0.1)
    with torch.no_grad():
        target.model.lm_head.weight[100] *= 8
    return target


def prompts(lengths, vocab=255, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("batch_size,block_size", [(3, 4), (8, 7), (1, 2)])
def test_every_row_decodes_as_it_would_alone(eager, batch_size, block_size, cached):
    target = agreeing_target(eager)
    drafter = tiny_drafter(target, block_size=block_size)
    rows = prompts([1, 5, 12, 3, 7, 20])
    batched = batched_speculative(target, drafter, rows, 24, batch_size=batch_size, cached=cached)
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


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("eager", [True, False])
def test_the_drafter_gets_the_same_inputs_as_alone(eager, cached):
    """Tokens can agree while inputs differ (drafts that ignore the context); hidden states cannot:
    each row's drafter output in each round equals the batch-1 decoder's, whatever the padding."""
    target = agreeing_target(eager)
    drafter = RecordingDrafter(tiny_drafter(target, block_size=5).config).eval()
    drafter.load_state_dict(tiny_drafter(target, block_size=5).state_dict())
    rows = prompts([2, 11, 6, 17])
    batched = batched_speculative(target, drafter, rows, 20, cached=cached)
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


@pytest.mark.parametrize("eager", [True, False])
def test_ragged_cache_holds_each_row_as_a_fresh_prefill_would(eager):
    """After a prefill of ragged prompts and a block whose rows keep 2, 4 and 1 columns, with the
    middle row dropped: every kept row's keys, values and context equal a fresh batch-1 prefill of
    its committed tokens, column for column, and its start is their count."""
    target = agreeing_target(eager)
    layer_ids = [0, 1]
    rows = prompts([3, 9, 5])
    block = torch.tensor(prompts([4, 4, 4], seed=1))
    ragged = RaggedCache(target, layer_ids)
    lengths = torch.tensor([len(r) for r in rows])
    _, context = ragged.prefill(_right_padded(rows, "cpu"), lengths)
    _, features = ragged.extend(block)
    kept, keep = torch.tensor([2, 4, 1]), torch.tensor([0, 2])
    index = ragged.advance(kept, keep)
    assert ragged.starts.tolist() == [3 + 2, 5 + 1] and index.shape == (2, 6)
    # the features, laid out as the drafter's cache lays out its keys: the same gather
    context = torch.cat([context, features], dim=1)[keep].gather(1, index[..., None].expand(-1, -1, context.shape[-1]))
    for out_row, r in enumerate(keep.tolist()):
        committed = torch.tensor([rows[r] + block[r, : kept[r]].tolist()])
        fresh = DynamicCache(config=target.model.config)
        with target.capture(layer_ids) as store:
            target.model(input_ids=committed, past_key_values=fresh, use_cache=True)
        n = committed.shape[1]
        for mine, theirs in zip(ragged.cache.layers, fresh.layers, strict=True):
            torch.testing.assert_close(mine.keys[out_row, :, :n], theirs.keys[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mine.values[out_row, :, :n], theirs.values[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(context[out_row, :n], torch.cat([store[i] for i in layer_ids], -1)[0],
                                   rtol=1e-5, atol=1e-5)


def test_ragged_draft_cache_appends_then_gathers_the_kept_rows_columns():
    """Keys coded by (row, column): after a first extend (rows 0-2, 2 columns) and a second one of 2
    new columns for rows 0 and 2, the gather index picks columns by hand-computed position."""
    def coded(rows, cols, base):
        return (base + torch.arange(rows)[:, None] * 10 + torch.arange(cols)).float().view(rows, 1, cols, 1)

    cache = RaggedDraftCache(num_layers=1)
    cache.reindex(torch.arange(3), torch.tensor([[0, 1], [0, 1], [0, 0]]))  # row 2 keeps one column
    k, _ = cache.extend(0, coded(3, 2, 0), coded(3, 2, 0))
    assert k.flatten(1).tolist() == [[0, 1], [10, 11], [20, 20]]
    cache.reindex(torch.tensor([0, 2]), torch.tensor([[0, 1, 2], [0, 2, 3]]))  # row 0 keeps 1 new, row 2 both
    k, v = cache.extend(0, coded(2, 2, 100), coded(2, 2, 100))
    assert k.flatten(1).tolist() == [[0, 1, 100], [20, 110, 111]] and torch.equal(k, v)


def test_cached_decoding_is_refused_with_the_reason_where_the_target_cannot_mask(monkeypatch):
    target = agreeing_target(eager=False)
    monkeypatch.setattr(target.model.config, "_attn_implementation", "flash_attention_2")
    assert "takes no custom 4D mask" in RaggedCache.supports(target)
    with pytest.raises(ValueError, match="flash_attention_2"):
        batched_speculative(target, tiny_drafter(target), [[1, 2]], 4, cached=True)
