"""The static-cache decoder (graphs off: the eager twin of what runs on the GPU) against independent
references: a cache-free greedy loop, and speculative_generate's decisions round by round."""

import pytest
import torch

from dflash_train.draft.model import DFlashDraftModel
from dflash_train.decode.spec_decode import speculative_generate
from dflash_train.decode.static_decode import StaticDecoder, static_cache_problem

from .test_spec_decode import ScriptedDrafter, prompt, reference_greedy
from tests.eval.tiny_models import tiny_drafter, tiny_target


def prompts_of(lengths, vocab):
    return [prompt(n, vocab, seed=n)[0].tolist() for n in lengths]


@pytest.mark.parametrize("rows,lengths,max_new,block_size", [(1, [5], 20, 4), (1, [1], 9, 2), (3, [5, 12, 1], 17, 7),
                                                             (4, [3, 8], 13, 4)])
def test_lossless_and_same_decisions_as_speculative_generate(target, drafter, rows, lengths, max_new, block_size):
    prompts = prompts_of(lengths, target.vocab_size)
    decoder = StaticDecoder(target, drafter, rows=rows, max_len=max(lengths) + max_new, block_size=block_size)
    greedy, spec = decoder.greedy(prompts, max_new), decoder.speculative(prompts, max_new)
    for p, base, res in zip(prompts, greedy.results, spec.results):
        ref = reference_greedy(target.model, torch.tensor([p]), max_new)
        eager = speculative_generate(target, drafter, torch.tensor([p]), max_new, block_size=block_size)
        assert base.tokens == ref and res.tokens == ref
        assert res.acceptance_lengths == eager.acceptance_lengths
        assert res.position_accepts == eager.position_accepts
    assert len(spec.draft_seconds) == len(spec.verify_seconds) == len(spec.bookkeeping_seconds) > 0
    assert spec.decode_seconds > 0 and greedy.decode_seconds > 0


class OracleDrafter(ScriptedDrafter):
    """The real drafter's forward (recorded: its hidden states depend on the context it was fed),
    pushed to propose `script(row, start, slot)` where that is not None: accepted lengths vary."""

    def __init__(self, cfg, lm_head, script):
        super().__init__(cfg, lm_head, script)
        self.rows, self.seen = [0], []

    def forward(self, context, block_embeds, ctx_positions, block_positions, mask=None, cache=None):
        hidden = DFlashDraftModel.forward(self, context, block_embeds, ctx_positions, block_positions, mask, cache)
        self.seen.append(hidden)
        boost = torch.zeros(hidden.shape[0], hidden.shape[1], self.lm_head.shape[0])
        for r in range(hidden.shape[0]):
            for k in range(hidden.shape[1]):
                token = self.script(self.rows[r], int(block_positions[r, 0]), k)
                if token is not None:
                    boost[r, k, token] = 50.0
        return hidden + torch.linalg.solve(self.lm_head, boost.transpose(1, 2)).transpose(1, 2)


def test_drafter_context_under_varying_acceptance():
    """Rounds accept 1..B tokens; each round the static drafter's hidden states (it sees the
    accepted tokens' features through its masked, never-cropped cache) equal the eager drafter's."""
    target = tiny_target(vocab_size=64)
    lengths, max_new, b = [4, 9], 30, 5
    prompts = prompts_of(lengths, 64)
    refs = [reference_greedy(target.model, torch.tensor([p]), max_new + b) for p in prompts]

    cuts = [4, 0, 2, 4, 1, 3, 0, 4, 2, 1, 3]

    def script(row, start, k):  # the right token up to a start-dependent slot, then the drafter's own
        return refs[row][start + k - len(prompts[row])] if 1 <= k <= cuts[start % len(cuts)] else None

    oracle = OracleDrafter(tiny_drafter(target, block_size=b).config, target.lm_head_weight, script).eval()
    oracle.load_state_dict(tiny_drafter(target, block_size=b).state_dict(), strict=False)
    eager = []
    for i, p in enumerate(prompts):
        oracle.rows, oracle.seen = [i], []
        res = speculative_generate(target, oracle, torch.tensor([p]), max_new, block_size=b)
        eager.append((res, oracle.seen))
    oracle.rows, oracle.seen = [0, 1], []
    static = StaticDecoder(target, oracle, rows=2, max_len=max(lengths) + max_new, block_size=b)
    oracle.seen = []  # not the capture's dummy forwards
    spec = static.speculative(prompts, max_new)
    for r, (res, seen) in enumerate(eager):
        assert spec.results[r].tokens == res.tokens == refs[r][:max_new]
        assert spec.results[r].acceptance_lengths == res.acceptance_lengths
        assert len(set(res.acceptance_lengths)) > 2
        for round_, hidden in enumerate(seen):
            torch.testing.assert_close(oracle.seen[round_][r : r + 1], hidden, rtol=1e-4, atol=1e-5)


def test_stop_token_ends_each_row(target, drafter):
    prompts = prompts_of([6, 3], target.vocab_size)
    free = [reference_greedy(target.model, torch.tensor([p]), 30) for p in prompts]
    stop = free[0][5]
    decoder = StaticDecoder(target, drafter, rows=2, max_len=40, block_size=3)
    for decoded in (decoder.greedy(prompts, 30, [stop]), decoder.speculative(prompts, 30, [stop])):
        for p, res in zip(prompts, decoded.results):
            assert res.tokens == reference_greedy(target.model, torch.tensor([p]), 30, stop_ids={stop})


def test_refusals(target, drafter):
    decoder = StaticDecoder(target, drafter, rows=1, max_len=10)
    with pytest.raises(ValueError, match="exceeds the decoder's max_len 10"):
        decoder.greedy([[1] * 5], 6)
    with pytest.raises(ValueError, match="1..1 prompts"):
        decoder.greedy([[1], [2]], 2)
    assert static_cache_problem(target.model) is None
    chunked = tiny_target(num_layers=2)
    chunked.model.config.layer_types, chunked.model.config.attention_chunk_size = ["chunked_attention"] * 2, 8
    assert "chunked_attention" in static_cache_problem(chunked.model)
    with pytest.raises(ValueError, match="no static decoding for tiny-qwen3"):
        StaticDecoder(chunked, None, rows=1, max_len=10)
