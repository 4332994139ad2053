"""On CUDA: the compiled, chunked distilled loss (train.compile) against a float64 reference, at the
SmolLM2 vocabulary, in the precision training uses (bf16 autocast, fp32 logits).

On a GPU host: `python -m pytest tests/gpu -m gpu`.
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.draft.loss import LossMix, block_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, H, V = 16, 576, 49152


@pytest.mark.parametrize("mix", [LossMix(), LossMix(ce=0.0, kl=1.0), LossMix(ce=0.5, kl=0.5, temperature=2.0)], ids=str)
def test_compiled_distilled_loss_matches_float64(mix):
    gen = torch.Generator().manual_seed(0)
    rows = 3 * 4096 + 200  # four chunks, the last one padded
    hidden = torch.randn(rows // B + 1, B, H, generator=gen)[: rows // B].cuda()
    head = (torch.randn(V, H, generator=gen) * 0.05).cuda()
    t_hidden = torch.randn(hidden.shape, generator=gen).cuda()
    t_head = (torch.randn(V, H, generator=gen) * 0.05).cuda()
    labels = torch.randint(0, V, hidden.shape[:2], generator=gen).cuda()
    weights = torch.rand(hidden.shape[:2], generator=gen).cuda()
    weights[:, 0] = 0
    h = hidden.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = block_loss(h, head, labels, weights, B, 4096, mix, t_hidden, lambda x: x @ t_head.t(), compiled=True)
    out.weighted_ce_sum.backward()

    h64 = hidden.double().requires_grad_()
    q = h64.reshape(-1, H) @ head.double().t()
    p = t_hidden.double().reshape(-1, H) @ t_head.double().t()
    per_row = mix.ce * (torch.logsumexp(q, -1) - q.gather(1, labels.reshape(-1, 1)).squeeze(1))
    t = mix.temperature
    log_p, log_q = torch.log_softmax(p / t, -1), torch.log_softmax(q / t, -1)
    per_row = per_row + mix.kl * t * t * (log_p.exp() * (log_p - log_q)).sum(-1)
    ref = (weights.double().reshape(-1) * per_row).sum()
    ref.backward()
    # bf16 operands: relative error between 1e-3 and 1e-2 is expected
    assert abs(float(out.weighted_ce_sum) - float(ref)) / abs(float(ref)) < 1e-2
    rel = (h.grad.double() - h64.grad).norm() / h64.grad.norm()
    assert rel < 2e-2, float(rel)
