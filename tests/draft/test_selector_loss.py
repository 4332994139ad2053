"""DFlash2's selector loss inside the chunked pass against a float64 slot-by-slot reference whose
gradients come from autograd: the loss, every gradient (hidden states, both codebooks, the hidden
projection), and the statistics, which count the selector's picks. Chunks cut blocks; the options
(a label outside the top-k joins or is skipped, slot or uniform weights, decay or D-PACE) each
against the reference; compiled against eager."""

from __future__ import annotations

import copy

import pytest
import torch

from dflash_train.draft.dflash2 import DFlash2DraftModel, selector_inputs
from dflash_train.draft.loss import LossMix, block_loss, dpace_weights
from dflash_train.draft.model import DraftModelConfig

BLOCK = 4


def drafter(seed: int, top_k: int = 3, vocab: int = 50) -> DFlash2DraftModel:
    cfg = DraftModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           intermediate_size=48, num_hidden_layers=1, vocab_size=vocab, block_size=BLOCK,
                           target_layer_ids=[0, 2], num_target_layers=4, mask_token_id=3, family="dflash2",
                           conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=top_k)
    model = DFlash2DraftModel(cfg)
    torch.manual_seed(seed)
    sel = model.candidate_selector
    for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
        torch.nn.init.normal_(p, std=0.5)
    return model


def problem(seed: int, b: int = 2, blocks: int = 3, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    q = blocks * BLOCK
    hidden = torch.randn(b, q, 32, generator=g)
    head = torch.randn(vocab, 32, generator=g)
    block_ids = torch.randint(0, vocab, (b, q), generator=g)
    labels = torch.randint(0, vocab, (b, q), generator=g)
    logits = hidden @ head.T
    labels[0, 5] = logits[0, 5].argmax()  # labels inside the top-k: counted once
    labels[1, 2] = logits[1, 2].topk(2).indices[1]
    labels[1, 9] = logits[1, 9].argmax()
    weights = torch.rand(b, q, generator=g) * (torch.arange(q) % BLOCK != 0)
    weights[1, 7] = 0  # a slot that does not count
    return hidden, head, block_ids, labels, weights


def reference(model, hidden, head, block_ids, labels, weights, mix: LossMix):
    """(loss, per-row 1.0 where the selector's pick after the true predecessor is the label), slot by
    slot in float64 (`model` and `hidden` float64; the rest upcast here)."""
    sel, top_k = model.candidate_selector, model.config.selector_top_k
    head, weights = head.double(), weights.double()
    log_q = torch.log_softmax(hidden @ head.T, -1)
    counted = (weights > 0).double()
    slot_w = torch.ones_like(weights)
    if mix.dpace_alpha is not None:
        q = log_q.gather(-1, labels[..., None]).squeeze(-1).exp().detach()
        slot_w = dpace_weights(q.view(-1, BLOCK), counted.view(-1, BLOCK), mix.dpace_alpha).view_as(q)
    total = -(mix.ce * weights * slot_w * log_q.gather(-1, labels[..., None]).squeeze(-1)).sum()
    sel_w = mix.selector * (weights if mix.selector_slot_weighted else counted)
    if mix.selector_slot_weighted:
        sel_w = sel_w * slot_w
    correct = torch.zeros_like(weights)
    for r in range(hidden.shape[0]):
        for t in range(hidden.shape[1]):
            if weights[r, t] <= 0:
                continue
            prev = int(block_ids[r, t - 1]) if t % BLOCK == 1 else int(labels[r, t - 1])
            logits = hidden[r, t] @ head.T
            cands = logits.detach().topk(top_k).indices.tolist()
            label = int(labels[r, t])
            gate = sel.hidden_projection(hidden[r, t])
            scores = torch.stack([logits[c] + (sel.predecessor_codebook[prev] * gate * sel.successor_codebook[c]).sum()
                                  for c in cands + ([label] if label not in cands else [])])
            correct[r, t] = float(cands[int(scores[:top_k].argmax())] == label)
            if label not in cands and not mix.selector_join:
                continue
            target = cands.index(label) if label in cands else top_k
            total = total + sel_w[r, t] * (torch.logsumexp(scores, 0) - scores[target])
    return total, correct


def ours(model, hidden, head, block_ids, labels, weights, mix, chunk, compiled=False):
    base = weights if mix.dpace_alpha is None else (weights > 0).float()  # D-PACE: the mask alone, as make_task
    sel_weights = mix.selector * (base if mix.selector_slot_weighted else (weights > 0).float())
    inputs = selector_inputs(model, hidden, block_ids, labels, sel_weights)
    return block_loss(hidden, head, labels, base, BLOCK, chunk, mix, compiled=compiled, selector=inputs)


def grads(model, hidden, loss):
    sel = model.candidate_selector
    params = [hidden, sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight]
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("chunk", [3, 7, 64])
@pytest.mark.parametrize("mix", [
    LossMix(ce=1.0, selector=1.0),
    LossMix(ce=0.5, selector=2.0, selector_join=False),
    LossMix(ce=1.0, selector=1.0, selector_slot_weighted=False),
    LossMix(ce=1.0, selector=1.0, dpace_alpha=0.5),
    LossMix(ce=1.0, selector=1.0, dpace_alpha=0.5, selector_slot_weighted=False, selector_join=False),
], ids=["join-slot", "skip", "uniform", "dpace", "dpace-uniform-skip"])
def test_the_chunked_selector_loss_and_its_gradients_match_the_reference(chunk, mix):
    model = drafter(0)
    model64 = copy.deepcopy(model).double()
    hidden, head, block_ids, labels, weights = problem(1)
    # D-PACE's task weights are the mask alone (draft/objective.py): the reference reads the same
    ref_weights = weights if mix.dpace_alpha is None else (weights > 0).float()
    h64 = hidden.double().requires_grad_()
    want, want_correct = reference(model64, h64, head, block_ids, labels, ref_weights, mix)
    hidden.requires_grad_()
    out = ours(model, hidden, head, block_ids, labels, weights, mix, chunk)
    torch.testing.assert_close(out.weighted_ce_sum.double(), want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads(model, hidden, out.weighted_ce_sum), grads(model64, h64, want)):
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.correct_per_slot, want_correct.view(-1, BLOCK).sum(0).float())
    assert out.correct_per_slot.sum() > 0  # the problem has labels the selector picks


def test_the_statistics_count_the_selectors_picks_not_the_argmax():
    """A successor codebook that overrules the logits: the argmax is right, the selector's pick is not."""
    model = drafter(0, top_k=2)
    hidden, head, block_ids, labels, weights = problem(2)
    logits = hidden @ head.T
    labels = logits.argmax(-1)
    with torch.no_grad():
        second = logits.topk(2).indices[..., 1]
        model.candidate_selector.successor_codebook.zero_()
        model.candidate_selector.successor_codebook[second.flatten(), 0] = 100.0
        model.candidate_selector.predecessor_codebook.fill_(1.0)
        model.candidate_selector.hidden_projection.weight.zero_()
        model.candidate_selector.hidden_projection.weight[0] = 1.0
        gate = model.candidate_selector.hidden_projection(hidden)[..., 0]
    out = ours(model, hidden, head, block_ids, labels, weights, LossMix(selector=1.0), 64)
    _, want = reference(copy.deepcopy(model).double(), hidden.double(), head, block_ids, labels, weights,
                        LossMix(selector=1.0))
    torch.testing.assert_close(out.correct_per_slot, want.view(-1, BLOCK).sum(0).float())
    counted = (weights > 0).view(-1, BLOCK).sum(0)
    assert out.correct_per_slot.sum() < counted.sum()  # rows with a positive gate pick the second candidate
    assert bool((gate > 0).any())


@pytest.mark.parametrize("vocab", [50, 320])
def test_the_compiled_chunk_equals_eager(vocab):
    """Compiled, every row runs (padded, rows that do not count at weight 0: no data-dependent index,
    as on a GPU); eager on the CPU leaves those rows out. Both give the same loss, picks and gradients;
    with a vocabulary of whole tiles the compiled chunk takes its statistics from them (vocab_tiles.py)."""
    model = drafter(2, vocab=vocab)
    hidden, head, block_ids, labels, weights = problem(4, vocab=vocab)
    weights[0, : 2 * BLOCK] = 0  # whole blocks that do not count
    hidden.requires_grad_()
    mix = LossMix(ce=1.0, selector=1.0)
    eager = ours(model, hidden, head, block_ids, labels, weights, mix, 8)
    compiled = ours(model, hidden, head, block_ids, labels, weights, mix, 8, compiled=True)
    torch.testing.assert_close(compiled.weighted_ce_sum, eager.weighted_ce_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled.correct_per_slot, eager.correct_per_slot)
    for a, b in zip(grads(model, hidden, compiled.weighted_ce_sum), grads(model, hidden, eager.weighted_ce_sum)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
