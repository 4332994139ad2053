"""Target-distilled losses (objective.loss: target_argmax, kl, l1, mixes) vs float64 references written from
their definitions; the label positions the target's hidden states are read at; the feature stream."""

from __future__ import annotations

import pytest
import torch

from dflash_train.draft import loss as loss_module
from dflash_train.draft import masks
from dflash_train.draft.loss import LossMix, block_loss
from dflash_train.draft.objective import split_features
from draft.test_loss import B, problem as base_problem


def problem(seed=0, v=37):
    """test_loss's problem (drafter states, head, labels, weights) plus the target's states and head."""
    hidden, head, labels, weights = base_problem(seed, v=v)
    gen = torch.Generator().manual_seed(1000 + seed)
    target_hidden = torch.randn(hidden.shape, generator=gen)
    target_head = torch.randn(head.shape, generator=gen) * 0.7
    return hidden, head, labels, weights, target_hidden, target_head


def reference(hidden, head, labels, weights, target_hidden, target_head, mix: LossMix):
    """Per-row losses in float64, each from its textbook definition (no log_softmax shortcuts)."""
    q_logits = hidden.double().reshape(-1, hidden.shape[-1]) @ head.double().t()
    p_logits = target_hidden.double().reshape(-1, hidden.shape[-1]) @ target_head.double().t()
    q = torch.softmax(q_logits, -1)
    total = torch.zeros(q.shape[0], dtype=torch.float64)
    rows = torch.arange(q.shape[0])
    total += mix.ce * -torch.log(q[rows, labels.reshape(-1)])
    total += mix.target_argmax * -torch.log(q[rows, p_logits.argmax(-1)])
    t = mix.temperature
    p_t, q_t = torch.softmax(p_logits / t, -1), torch.softmax(q_logits / t, -1)
    total += mix.kl * t * t * (p_t * torch.log(p_t / q_t)).sum(-1)
    total += mix.l1 * (q - torch.softmax(p_logits, -1)).abs().sum(-1)
    return (weights.double().reshape(-1) * total).sum(), q_logits.argmax(-1) == p_logits.argmax(-1)


MIXES = [
    LossMix(ce=0, target_argmax=1),
    LossMix(ce=0, kl=1),
    LossMix(ce=0, kl=1, temperature=2.0),
    LossMix(ce=0.3, target_argmax=0.2, kl=0.5, temperature=0.7),
    LossMix(ce=0, l1=1),
    LossMix(ce=0.1, l1=0.9),  # SpecForge's DSpark recipe
]


@pytest.mark.parametrize("mix", MIXES, ids=str)
@pytest.mark.parametrize("chunk_size", [1, 7, 4096])
def test_distilled_loss_equals_float64_reference(mix, chunk_size):
    hidden, head, labels, weights, t_hidden, t_head = problem()
    ref, agree = reference(hidden, head, labels, weights, t_hidden, t_head, mix)
    out = block_loss(hidden, head, labels, weights, B, chunk_size, mix, t_hidden, lambda x: x @ t_head.t())
    torch.testing.assert_close(out.weighted_ce_sum.double(), ref, rtol=1e-5, atol=1e-5)
    # Accuracy counts agreement with the target's argmax (what acceptance tests), not the data token.
    counted = (weights.reshape(-1) > 0).double()
    torch.testing.assert_close(out.correct_per_slot.double(), (agree.double() * counted).view(-1, B).sum(0))


@pytest.mark.parametrize("mix", MIXES, ids=str)
def test_distilled_gradients_match_float64(mix):
    hidden, head, labels, weights, t_hidden, t_head = problem(seed=3)
    h64 = hidden.double().requires_grad_()
    reference(h64, head, labels, weights, t_hidden, t_head, mix)[0].backward()
    h = hidden.clone().requires_grad_()
    block_loss(h, head, labels, weights, B, 6, mix, t_hidden, lambda x: x @ t_head.t()).weighted_ce_sum.backward()
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)


def test_kl_to_itself_is_zero_and_argmax_of_data_equals_ce():
    """Sanity that can fail: a drafter equal to the target has KL 0; when the target's argmax IS the
    data token (greedy self-generated data), target_argmax equals ce."""
    hidden, head, labels, weights, _, _ = problem(seed=4)
    same = block_loss(hidden, head, labels, weights, B, 8, LossMix(ce=0, kl=1), hidden, lambda x: x @ head.t())
    assert abs(float(same.weighted_ce_sum)) < 1e-5
    # One chunk (4096 rows): the "target" puts its maximum on each row's data token.
    one_hot = torch.nn.functional.one_hot(labels.reshape(-1), head.shape[0]).float()
    # The one-hot rows travel as the "target states" (identity head): the loss may pass a subset of rows.
    as_argmax = block_loss(hidden, head, labels, weights, B, 4096, LossMix(ce=0, target_argmax=1), one_hot,
                           lambda rows: rows)
    as_ce = block_loss(hidden, head, labels, weights, B, 4096)
    torch.testing.assert_close(as_argmax.weighted_ce_sum, as_ce.weighted_ce_sum)


def test_distilling_without_target_states_is_refused():
    hidden, head, labels, weights, _, _ = problem()
    with pytest.raises(ValueError, match="distils from the target"):
        block_loss(hidden, head, labels, weights, B, 8, LossMix(ce=0, kl=1))


def test_label_source_positions_by_brute_force():
    anchors = torch.tensor([[0, 3, 9], [5, 6, 0]])
    t = 12
    got = masks.label_source_positions(anchors, B, t)
    for r in range(2):
        for j, a in enumerate(anchors[r].tolist()):
            for k in range(B):
                want = min(max(a + k - 1, 0), t - 1)  # slot k's label token[a+k] is predicted at a+k-1
                assert got[r, j * B + k] == want


def test_split_features():
    feats = torch.randn(2, 5, 3 * 8)
    assert split_features(feats, 3, 8)[1] is None
    drafter, final = split_features(torch.cat([feats, feats[..., :8]], -1), 3, 8)
    torch.testing.assert_close(drafter, feats)
    torch.testing.assert_close(final, feats[..., :8])
    with pytest.raises(ValueError, match="width"):
        split_features(feats[..., :20], 3, 8)


@pytest.mark.parametrize("even_chunks", [False, True])
@pytest.mark.parametrize("mix", [LossMix(), LossMix(ce=0.3, target_argmax=0.2, kl=0.5, temperature=0.7),
                                 LossMix(ce=0.3, target_argmax=0.2, kl=0.5, temperature=0.7, dpace_alpha=0.5),
                                 LossMix(ce=0.1, l1=0.9)], ids=str)
@pytest.mark.parametrize("v", [37, 192])
def test_compiled_chunks_equal_eager(mix, even_chunks, v, monkeypatch):
    """compiled=True pads the last chunk with zero-weight rows and runs each chunk compiled: the same
    loss, accuracy counts and gradients as eager (here 40 rows in chunks of at most 24: 24 + 16 and 8
    padded rows, or with even_chunks 20 + 20 and none); a vocabulary of whole tiles (192) takes the
    compiled statistics from them (vocab_tiles.py)."""
    hidden, head, labels, weights, t_hidden, t_head = problem(seed=5, v=v)
    target_fn = lambda x: x @ t_head.t()  # noqa: E731
    chunks = []  # the rows of each chunk, as the loss runs them
    run_chunk = loss_module._run_chunk
    monkeypatch.setattr(loss_module, "_run_chunk",
                        lambda fn, h, *a, **k: chunks.append(h.shape[0]) or run_chunk(fn, h, *a, **k))
    outs, grads = [], []
    for compiled in (False, True):
        h = hidden.clone().requires_grad_()
        out = block_loss(h, head, labels, weights, B, 24, mix, t_hidden, target_fn, compiled=compiled,
                         even_chunks=even_chunks)
        out.weighted_ce_sum.backward()
        outs.append(out)
        grads.append(h.grad)
    torch.testing.assert_close(outs[1].weighted_ce_sum, outs[0].weighted_ce_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1].correct_per_slot, outs[0].correct_per_slot)
    torch.testing.assert_close(outs[1].counted_per_slot, outs[0].counted_per_slot)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    # eager on CPU leaves out the zero-weight rows before chunking; compiled keeps every row
    assert chunks[-2:] == ([20, 20] if even_chunks else [24, 24])


def test_zero_weight_rows_are_skipped_and_a_batch_without_counted_rows_still_backpropagates():
    """On CPU the zero-weight rows never reach the LM head; with none counted the loss is 0 and
    backward still runs (the micro-batch joins the step's gradient with zeros)."""
    hidden, head, labels, weights, _, _ = problem(seed=5)
    hidden.requires_grad_(True)
    out = block_loss(hidden, head, labels, torch.zeros_like(weights), B, 8)
    out.weighted_ce_sum.backward()
    assert float(out.weighted_ce_sum) == 0 and hidden.grad.abs().sum() == 0
    assert out.counted_per_slot.sum() == 0 and out.correct_per_slot.sum() == 0
