"""Speculative decoding against independent references: a cache-free greedy loop, hand-computed
acceptance, exact target marginals for sampling."""

import pytest
import torch
import torch.nn.functional as F

from dflash_train.draft.model import DFlashDraftModel
from dflash_train.decode.batched import batched_speculative
from dflash_train.eval.report import stop_token_ids
from dflash_train.decode.spec_decode import accept_sampled, speculative_generate, target_greedy

from tests.eval.tiny_models import tiny_drafter, tiny_target


def reference_greedy(model, input_ids, max_new_tokens, stop_ids=()):
    """The textbook loop: full forward over the whole sequence, no cache, argmax, repeat."""
    ids, out = input_ids, []
    while len(out) < max_new_tokens:
        token = int(model(input_ids=ids, use_cache=False).logits[0, -1].argmax())
        out.append(token)
        if token in stop_ids:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def prompt(length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (1, length), generator=g)


@pytest.mark.parametrize("prompt_len,max_new,block_size", [(1, 9, 2), (5, 20, 4), (12, 17, 7), (3, 1, 4)])
def test_greedy_equals_reference(target, drafter, prompt_len, max_new, block_size):
    ids = prompt(prompt_len, target.vocab_size, seed=prompt_len)
    ref = reference_greedy(target.model, ids, max_new)
    assert target_greedy(target, ids, max_new).tokens == ref
    res = speculative_generate(target, drafter, ids, max_new, block_size=block_size)
    assert res.tokens == ref
    assert all(1 <= a <= block_size for a in res.acceptance_lengths)


def test_greedy_stops_at_stop_token(target, drafter):
    ids = prompt(6, target.vocab_size, seed=3)
    free = reference_greedy(target.model, ids, 30)
    # A stop token whose first occurrence is a few tokens in, so several rounds run before it.
    i = next(i for i in range(3, 30) if free[i] not in free[:i])
    ref = reference_greedy(target.model, ids, 30, stop_ids={free[i]})
    assert ref == free[: i + 1]
    assert target_greedy(target, ids, 30, stop_ids=[free[i]]).tokens == ref
    assert speculative_generate(target, drafter, ids, 30, stop_ids=[free[i]], block_size=3).tokens == ref


class RecordingDrafter(DFlashDraftModel):
    """Records what the drafter is fed, and checks the cached forward against an uncached one."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.contexts, self.positions = [], []

    def forward(self, context, block_embeds, ctx_positions, block_positions, mask=None, cache=None):
        self.contexts.append(context)
        self.positions.append(ctx_positions)
        hidden = super().forward(context, block_embeds, ctx_positions, block_positions, mask, cache)
        full = super().forward(torch.cat(self.contexts, 1), block_embeds, torch.cat(self.positions, 1), block_positions)
        torch.testing.assert_close(hidden, full, rtol=1e-4, atol=1e-5)
        return hidden


def test_drafter_sees_the_targets_features_of_every_verified_position(target):
    drafter = RecordingDrafter(tiny_drafter(target).config).eval()
    ids = prompt(5, target.vocab_size, seed=7)
    res = speculative_generate(target, drafter, ids, 25, block_size=4)
    positions = torch.cat(drafter.positions, 1)[0]
    assert positions.tolist() == list(range(positions.shape[0]))  # contiguous, each position once
    # Independent reference: one cache-free forward over the final sequence.
    seq = torch.cat([ids, torch.tensor([res.tokens])], dim=1)
    full = target.features(seq, drafter.config.target_layer_ids)
    torch.testing.assert_close(torch.cat(drafter.contexts, 1), full[:, : positions.shape[0]], rtol=1e-4, atol=1e-5)


class ScriptedDrafter(DFlashDraftModel):
    """Proposes `script(start, slot)` in each slot. The target's LM head is square here, so the
    hidden state giving any logits is a linear solve."""

    def __init__(self, cfg, lm_head, script):
        super().__init__(cfg)
        self.lm_head, self.script = lm_head, script

    def forward(self, context, block_embeds, ctx_positions, block_positions, mask=None, cache=None):
        super().forward(context, block_embeds, ctx_positions, block_positions, mask, cache)  # keeps the cache real
        start, size = int(block_positions[0, 0]), block_positions.shape[1]
        tokens = torch.tensor([self.script(start, k) for k in range(size)])
        logits = 20.0 * F.one_hot(tokens, self.lm_head.shape[0]).float()
        return torch.linalg.solve(self.lm_head, logits.T).T[None]  # h @ W.T = logits


@pytest.fixture(scope="module")
def square_target():
    return tiny_target(vocab_size=64)


def scripted(target, script, block_size):
    cfg = tiny_drafter(target, block_size=block_size).config
    return ScriptedDrafter(cfg, target.lm_head_weight, script).eval()


def test_acceptance_accounting_by_hand(square_target):
    ids = prompt(5, 64, seed=11)
    p = ids.shape[1]
    ref = reference_greedy(square_target.model, ids, 60)

    def three_then_miss(start, k):  # slots 1-3 right, 4 wrong, 5-15 right again: 3 of 15 count
        token = ref[start + k - p]
        return (token + 1) % 63 if k == 4 else token

    res = speculative_generate(square_target, scripted(square_target, three_then_miss, 16), ids, 13)
    assert res.tokens == ref[:13]  # 1 from the prefill + 3 rounds x (3 accepted + the correction)
    assert res.acceptance_lengths == [4, 4, 4]
    assert res.position_accepts == [3, 3, 3] + [0] * 12
    assert res.tau == 4.0

    perfect = scripted(square_target, lambda start, k: ref[start + k - p], 16)
    res = speculative_generate(square_target, perfect, ids, 22)
    assert res.tokens == ref[:22]  # 1 + 16, then a second full round cut to 5 by the budget
    assert res.acceptance_lengths == [16, 16]
    assert res.position_accepts == [2] * 15


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; bins expecting < 5 counts are pooled into one."""
    n = samples.numel()
    observed = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * n
    small = expected < 5
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2))


def test_accept_sampled_emits_target_samples():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(2 * torch.randn(3, 6, generator=g), -1)  # target, 3 slots
    q = torch.softmax(2 * torch.randn(2, 6, generator=g), -1)  # drafter, 2 proposals
    first, second = [], []
    for _ in range(4000):
        proposals = torch.multinomial(q, 1, generator=g)[:, 0]
        n, token = accept_sampled(proposals, q, p, g)
        emitted = proposals[:n].tolist() + [token]
        first.append(emitted[0])
        if len(emitted) > 1:
            second.append(emitted[1])
    assert chi_square_pvalue(torch.tensor(first), p[0]) > 1e-3
    assert chi_square_pvalue(torch.tensor(second), p[1]) > 1e-3
    assert chi_square_pvalue(torch.tensor(first), q[0]) < 1e-6  # the test can tell p from q


def test_accept_sampled_accepts_everything_when_drafter_equals_target():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(8, 32, generator=g), -1)
    for _ in range(200):
        proposals = torch.multinomial(p[:-1], 1, generator=g)[:, 0]
        assert accept_sampled(proposals, p[:-1], p, g)[0] == 7


@pytest.mark.slow(seconds=15)
@pytest.mark.parametrize("batched", [False, True])
def test_sampled_generation_follows_target_marginals(batched):
    """Tokens 2 and 3 (decided by verification) have the target's exact marginals, decoding one
    sequence at a time or all 800 together."""
    target = tiny_target(vocab_size=16, num_layers=2, seed=5)
    drafter = tiny_drafter(target, block_size=4, layer_ids=(0, 1), num_layers=1, seed=6)
    ids = prompt(4, 16, seed=2)
    v = 16
    with torch.no_grad():  # exact marginals: enumerate all first two tokens in one batch
        p1 = torch.softmax(target.model(input_ids=ids).logits[0, -1], -1)
        seqs = torch.cat([ids.expand(v * v, -1), torch.arange(v).repeat_interleave(v)[:, None],
                          torch.arange(v).repeat(v)[:, None]], dim=1)
        probs = torch.softmax(target.model(input_ids=seqs).logits, -1)
        p2_given_1 = probs[::v, -2]  # [t1, t2]
        p3_given_12 = probs[:, -1]  # [t1*v + t2, t3]
    joint12 = p1[:, None] * p2_given_1
    marginal2 = joint12.sum(0)
    marginal3 = (joint12.reshape(-1, 1) * p3_given_12).sum(0)
    g = torch.Generator().manual_seed(0)
    if batched:
        decoded = batched_speculative(target, drafter, ids.tolist() * 800, 3, temperature=1.0, generator=g,
                                      batch_size=800)
    else:
        decoded = [speculative_generate(target, drafter, ids, 3, temperature=1.0, generator=g) for _ in range(800)]
    samples = torch.tensor([d.tokens for d in decoded])
    assert chi_square_pvalue(samples[:, 0], p1) > 1e-3
    assert chi_square_pvalue(samples[:, 1], marginal2) > 1e-3
    assert chi_square_pvalue(samples[:, 2], marginal3) > 1e-3


@pytest.mark.slow(seconds=20)
def test_greedy_equals_reference_on_smollm2(smollm2):
    drafter = tiny_drafter(smollm2, block_size=8, layer_ids=(1, 14, 27), num_layers=1)
    stop_ids = stop_token_ids(smollm2)
    assert stop_ids == [2]  # <|im_end|>
    for question in ["What is the capital of France?", "Write a haiku about rain."]:
        text = smollm2.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        ids = smollm2.tokenizer(text, return_tensors="pt").input_ids
        ref = reference_greedy(smollm2.model, ids, 12, stop_ids=set(stop_ids))
        assert speculative_generate(smollm2, drafter, ids, 12, stop_ids=stop_ids).tokens == ref


def test_training_blocks_equal_the_blocks_drafted_at_inference(target):
    """Train/inference parity: the block the objective trains at anchor a (features of the whole
    sequence, masked to positions < a) gives the same proposals as the block speculative decoding
    drafts once a is the last verified token (features of positions < a only, fresh draft cache)."""
    from dflash_train.draft.model import DraftKVCache
    from dflash_train.config_model import ObjectiveConfig
    from dflash_train.draft.objective import draft_hidden, make_task
    from dflash_train.decode.spec_decode import draft_block

    drafter = tiny_drafter(target, block_size=5)
    ids = prompt(30, target.vocab_size, seed=3)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 6:] = 1
    task = make_task(ids, loss_mask, ObjectiveConfig(num_anchors=7, block_size=5, gamma=7.0), anchor_seed=0)
    features = target.features(ids, drafter.config.target_layer_ids)
    trained = draft_hidden(drafter, task, features, target.embed_weight, use_flex=False)[0] @ target.lm_head_weight.T
    anchors = task.anchors[0][task.valid[0]].tolist()
    assert len(anchors) == 7
    for n, a in enumerate(anchors):
        block = torch.tensor([int(ids[0, a])] + [drafter.config.mask_token_id] * 4)
        cache = DraftKVCache(drafter.config.num_hidden_layers)
        drafted = draft_block(drafter, target, block, a, features[:, :a], cache)[0, 1:] @ target.lm_head_weight.T
        torch.testing.assert_close(drafted, trained[n * 5 + 1 : n * 5 + 5], rtol=1e-4, atol=1e-4)
