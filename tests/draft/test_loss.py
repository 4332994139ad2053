"""Chunked block loss vs a float64 reference; global normalisation; acceptance metrics by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_train.config import ConfigError, build_config
from dflash_train.config_model import ObjectiveConfig
from dflash_train.draft.acceptance import acceptance_metrics
from dflash_train.draft.loss import LossMix, block_loss, chunk_rows
from dflash_train.draft.objective import BlockTask, draft_loss, make_task
from draft.helpers_draft import tiny_drafter

B = 4


def problem(seed=0, b=2, n=5, h=16, v=37):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, n * B, h, generator=gen)
    head = torch.randn(v, h, generator=gen) * 0.5
    labels = torch.randint(0, v, (b, n * B), generator=gen)
    weights = torch.rand(b, n * B, generator=gen)
    weights[torch.rand(b, n * B, generator=gen) < 0.3] = 0
    weights.view(b, n, B)[:, :, 0] = 0
    return hidden, head, labels, weights


def reference(hidden, head, labels, weights):
    logits = hidden.double().reshape(-1, hidden.shape[-1]) @ head.double().t()
    ce = torch.logsumexp(logits, -1) - logits.gather(1, labels.reshape(-1, 1)).squeeze(1)
    return (weights.double().reshape(-1) * ce).sum(), logits


@pytest.mark.parametrize("even_chunks", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 16, 4096])
def test_block_loss_equals_float64_reference(chunk_size, even_chunks):
    hidden, head, labels, weights = problem()
    ref, logits = reference(hidden, head, labels, weights)
    out = block_loss(hidden, head, labels, weights, B, chunk_size, even_chunks=even_chunks)
    torch.testing.assert_close(out.weighted_ce_sum.double(), ref, rtol=1e-5, atol=1e-5)
    counted = (weights.reshape(-1) > 0).double()
    correct = (logits.argmax(-1) == labels.reshape(-1)).double() * counted
    torch.testing.assert_close(out.counted_per_slot.double(), counted.view(-1, B).sum(0))
    torch.testing.assert_close(out.correct_per_slot.double(), correct.view(-1, B).sum(0))
    accepted = torch.zeros(B, dtype=torch.float64)  # brute force: walk each block until its first miss
    for block_correct, block_counted in zip(correct.view(-1, B).tolist(), counted.view(-1, B).tolist()):
        if block_counted[1]:
            accepted[0] += 1
            for k in range(1, B):
                if not block_correct[k]:
                    break
                accepted[k] += 1
    torch.testing.assert_close(out.accepted_per_slot.double(), accepted)


def test_block_loss_gradients_match_across_chunk_sizes():
    hidden, head, labels, weights = problem(seed=1)
    h64 = hidden.double().requires_grad_()
    reference(h64, head, labels, weights)[0].backward()
    for chunk_size in (3, 16, 4096):
        h = hidden.clone().requires_grad_()
        block_loss(h, head, labels, weights, B, chunk_size).weighted_ce_sum.backward()
        torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)


def test_block_loss_scales_its_gradient_by_the_upstream_one():
    """The chunk's gradient is formed in its forward: the backward must still apply what flows into
    the loss (the global normalisation, gradient accumulation's sums)."""
    hidden, head, labels, weights = problem(seed=4)
    h64 = hidden.double().requires_grad_()
    (reference(h64, head, labels, weights)[0] * -0.37).backward()
    h = hidden.clone().requires_grad_()
    (block_loss(h, head, labels, weights, B, 7).weighted_ce_sum * -0.37).backward()
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)


def test_a_trainable_head_is_refused():
    hidden, head, labels, weights = problem()
    with pytest.raises(ValueError, match="frozen"):
        block_loss(hidden, head.requires_grad_(), labels, weights, B, 8)


@pytest.mark.parametrize("rows,max_rows,expected", [
    (24576, 24576, 24576),   # the SmolLM2 step (48 x 32 anchors x 16): one chunk
    (65536, 24576, 21888),   # 3 chunks of 21,845.3 -> 21,888 (a multiple of 64): 128 rows padded, not 8,192
    (43008, 24576, 21504),   # 2 even chunks, nothing padded
    (32768, 24576, 16384),
    (8192, 4096, 4096),      # the 8B shape (512 anchors x 16): unchanged
    (40, 24, 20),            # under 64: no rounding
    (40, 16, 14),            # 3 chunks of 14, 14, 12
    (5, 4096, 5), (0, 16, 1),
])
def test_chunk_rows_splits_evenly_under_the_bound(rows, max_rows, expected):
    size = chunk_rows(rows, max_rows)
    assert size == expected and size <= max_rows
    chunks = -(-rows // size)
    assert chunks == max(1, -(-rows // max_rows)) or rows == 0  # never more chunks than needed


def test_zero_weight_tokens_get_no_gradient():
    hidden, head, labels, weights = problem(seed=2)
    h = hidden.clone().requires_grad_()
    block_loss(h, head, labels, weights, B, 8).weighted_ce_sum.backward()
    assert (h.grad.reshape(-1, h.shape[-1])[weights.reshape(-1) == 0] == 0).all()


def test_acceptance_metrics_by_hand():
    correct = torch.tensor([0.0, 8, 6, 3, 0])
    counted = torch.tensor([0.0, 10, 10, 6, 0])
    accepted = torch.tensor([10.0, 8, 6, 3, 0])  # errors together: each block that hits slot 2 hit slot 1
    m = acceptance_metrics(correct, counted, accepted)
    assert m["acc"] == pytest.approx([0.8, 0.6, 0.5, 0.0])
    assert m["tau_hat"] == pytest.approx(1 + 0.8 + 0.8 * 0.6 + 0.8 * 0.6 * 0.5)
    assert m["tau_accept"] == pytest.approx(1 + (8 + 6 + 3) / 10)  # above tau_hat: correlated slots
    perfect = acceptance_metrics(torch.tensor([0.0, 4, 4, 4]), torch.tensor([0.0, 4, 4, 4]), torch.tensor([4.0, 4, 4, 4]))
    assert perfect["tau_hat"] == pytest.approx(4.0) and perfect["tau_accept"] == pytest.approx(4.0)


def test_split_micro_batches_equal_one_merged_padded_batch():
    """The trainer's normalisation: sum(w*CE)/sum(w) over the step, however it is split or padded.

    Two sequences of different lengths as two micro-batches (each weighted sum divided by the GLOBAL
    weight sum) must give the loss and gradients of one right-padded batch holding both, with
    garbage features in the padding (it must be invisible)."""
    drafter = tiny_drafter(seed=3)
    d = drafter.config
    gen = torch.Generator().manual_seed(5)
    embed = torch.randn(d.vocab_size, d.hidden_size, generator=gen)
    head = torch.randn(d.vocab_size, d.hidden_size, generator=gen) * 0.3
    k_h = len(d.target_layer_ids) * d.hidden_size
    lengths = (14, 9)
    seqs = [torch.randint(0, 59, (1, t), generator=gen) for t in lengths]
    lms = [torch.ones(1, t, dtype=torch.long) for t in lengths]
    for lm in lms:
        lm[0, :3] = 0
    feats = [torch.randn(1, t, k_h, generator=gen) for t in lengths]
    objective = ObjectiveConfig(num_anchors=4, block_size=d.block_size, gamma=7.0)
    tasks = [make_task(s, lm, objective, seed) for s, lm, seed in zip(seqs, lms, (11, 12))]

    denom = sum(t.weights.sum() for t in tasks)
    split = 0.0
    for s_task, f in zip(tasks, feats):
        split = split + draft_loss(drafter, s_task, f, embed, head, False, 16).weighted_ce_sum / denom
    split.backward()
    grads_split = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()

    t = max(lengths)
    merged = BlockTask(
        input_ids=torch.cat([F.pad(s, (0, t - s.shape[1]), value=0) for s in seqs]),
        anchors=torch.cat([x.anchors for x in tasks]),
        valid=torch.cat([x.valid for x in tasks]),
        labels=torch.cat([x.labels for x in tasks]),
        weights=torch.cat([x.weights for x in tasks]),
    )
    merged_feats = torch.cat(
        [torch.cat([f, 1e3 * torch.randn(1, t - f.shape[1], k_h, generator=gen)], 1) for f in feats]
    )
    out = draft_loss(drafter, merged, merged_feats, embed, head, False, 16)
    loss = out.weighted_ce_sum / merged.weights.sum()
    loss.backward()
    torch.testing.assert_close(loss, split, rtol=1e-5, atol=1e-6)
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(p.grad, grads_split[n], rtol=1e-4, atol=1e-6, msg=n)


def test_fused_ce_kernels_are_refused_where_they_cannot_run():
    """train.ce_kernel=liger/cce: CUDA only and the CE loss only, each refused with the key named,
    in the config and in the loss itself (a device resolved to CPU at run time)."""
    with pytest.raises(ConfigError, match="runs on CUDA only"):
        build_config({"device": "cpu", "train": {"ce_kernel": "liger"}})
    with pytest.raises(ConfigError, match="computes the CE loss only"):
        build_config({"device": "cuda", "train": {"ce_kernel": "cce"}, "objective": {"loss": {"ce": 0.5, "kl": 0.5}}})
    with pytest.raises(ConfigError, match="train.compile_loss compiles: set one"):
        build_config({"device": "cuda", "train": {"ce_kernel": "liger", "compile_loss": True}})
    with pytest.raises(ConfigError, match="needs the target's head in bfloat16"):
        build_config({"device": "cuda", "train": {"ce_kernel": "liger"}, "target": {"dtype": "float32"}})
    assert build_config({"device": "cuda", "train": {"ce_kernel": "cce"}}).train.ce_kernel == "cce"
    assert build_config({"device": "cuda", "train": {"ce_kernel": "liger"},  # a zero weight distils nothing
                         "objective": {"loss": {"ce": 1.0, "kl": 0.0}}}).train.ce_kernel == "liger"
    h, head = torch.randn(2, 4, 8), torch.randn(32, 8)
    labels, weights = torch.randint(0, 32, (2, 4)), torch.ones(2, 4)
    with pytest.raises(ValueError, match="runs on CUDA only"):
        block_loss(h, head, labels, weights, 4, kernel="liger")
    with pytest.raises(ValueError, match="computes the CE loss only"):
        block_loss(h, head, labels, weights, 4, mix=LossMix(ce=0.0, kl=1.0), target_hidden_BQH=h,
                   target_logits_fn=lambda x: x @ head.t(), kernel="cce")
