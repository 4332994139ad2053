"""On CUDA: the fused LM head + CE kernels of `train.ce_kernel` (liger-kernel, cut-cross-entropy)
against a float64 reference at the SmolLM2 vocabulary, with decay weights, zero-weight rows and the
global normalisation of training; their per-slot statistics against the chunked loss's.

On a GPU host: `python -m pytest tests/gpu -m gpu` (with the `fused-ce` extra's wheels).
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash_train.draft.loss import block_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, H, V = 16, 576, 49152
LIBRARIES = {"chunked": None, "liger": "liger_kernel", "cce": "cut_cross_entropy"}


# Measured on the H200 (2026-12-02, cut-cross-entropy 25.1.1): CCE's gradient is 2.4% off float64's,
# over the 2e-2 that chunked and liger meet; strict, so a release that fixes it shows up here.
CCE_GRADIENT = pytest.mark.xfail(strict=True, reason="CCE's bf16 backward: gradient 2.4% off float64 (2e-2 bound)")


@pytest.mark.parametrize("kernel", ["chunked", "liger", pytest.param("cce", marks=CCE_GRADIENT)])
def test_fused_ce_matches_float64_and_counts_like_the_chunked_loss(kernel):
    if LIBRARIES[kernel]:
        pytest.importorskip(LIBRARIES[kernel])
    gen = torch.Generator().manual_seed(0)
    blocks = 3 * 4096 // B + 13  # several chunks, the last one short
    hidden = torch.randn(blocks, B, H, generator=gen).cuda()
    head = (torch.randn(V, H, generator=gen) * 0.05).to(torch.bfloat16).cuda()  # the frozen target's head
    # 70% of the labels are the head's own argmax, so the kernels' argmax (the acceptance metrics)
    # is checked on thousands of correct rows, not on the ~0 hits of random labels
    labels = torch.randint(0, V, (blocks, B), generator=gen).cuda()
    top = (hidden.reshape(-1, H).double() @ head.double().t()).argmax(-1).view(blocks, B)
    labels = torch.where(torch.rand(blocks, B, generator=gen).cuda() < 0.7, top, labels)
    weights = torch.tensor([0.0] + [math.exp(-(k - 1) / 7) for k in range(1, B)]).repeat(blocks, 1)
    weights[torch.rand(blocks, generator=gen) < 0.2] = 0  # invalid anchors: rows that count for nothing
    weights = weights.cuda()
    denominator = weights.sum()

    def run(which):
        h = hidden.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = block_loss(h, head, labels, weights, B, 4096, kernel=which)
        (out.weighted_ce_sum / denominator).backward()
        return out, h.grad

    out, grad = run(kernel)
    h64 = hidden.double().requires_grad_()
    q = h64.reshape(-1, H) @ head.double().t()
    per_row = torch.logsumexp(q, -1) - q.gather(1, labels.reshape(-1, 1)).squeeze(1)
    ref = (weights.double().reshape(-1) * per_row).sum() / denominator.double()
    ref.backward()
    # bf16 operands: relative error between 1e-3 and 1e-2 is expected
    assert abs(float(out.weighted_ce_sum / denominator) - float(ref)) / abs(float(ref)) < 1e-2
    assert float((grad.double() - h64.grad).norm() / h64.grad.norm()) < 2e-2
    assert float(grad[weights == 0].abs().max()) == 0.0  # rows that do not count get no gradient

    chunked, _ = run("chunked")
    assert abs(float(out.weighted_ce_sum - chunked.weighted_ce_sum)) / abs(float(chunked.weighted_ce_sum)) < 5e-3
    correct = float(out.correct_per_slot.sum())
    assert correct > 0.6 * float(out.counted_per_slot[1:].sum())  # the planted argmax labels were found
    # the argmax of bf16 logits may differ from the float64 one on near-ties: a few rows in ~12K
    assert float((out.correct_per_slot - chunked.correct_per_slot).abs().sum()) <= 8
    assert float((out.accepted_per_slot - chunked.accepted_per_slot).abs().sum()) <= 8
