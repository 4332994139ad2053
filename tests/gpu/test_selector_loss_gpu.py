"""On CUDA: DFlash2's selector loss inside the compiled chunked pass against a float64 reference at the
SmolLM2 vocabulary, in the precision training uses (bf16 autocast, fp32 logits); the DFlash2 step, as
the DFlash one, makes no host sync. Run: `python -m pytest tests/gpu -m gpu`."""

from __future__ import annotations

import pytest
import torch

from dflash_train.draft.dflash2 import DFlash2DraftModel, selector_inputs
from dflash_train.draft.loss import LossMix, block_loss
from dflash_train.draft.model import DraftModelConfig
from dflash_train.draft.vocab_tiles import tiled_top_k
from dflash_train.train.loop import Trainer

from tiny import DFLASH2, GPU_RECIPE, no_host_sync, tiny_target, to_cuda  # tests/ is on sys.path (conftest.py)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, H, V, K = 16, 576, 49152, 4


def selector_reference(h64, head64, labels, prev, weights64, sel, top):
    """CE + selector CE over the candidates `top` [rows, K], a label outside them joining, in float64."""
    logits = h64 @ head64.t()
    ce = torch.logsumexp(logits, -1) - logits.gather(1, labels[:, None]).squeeze(1)
    ids = torch.cat([top, labels[:, None]], 1)
    found = (top == labels[:, None]).any(1)
    gate = sel.predecessor_codebook.double()[prev] * (h64 @ sel.hidden_projection.weight.double().t())
    scores = logits.gather(1, ids) + (gate[:, None, :] * sel.successor_codebook.double()[ids]).sum(-1)
    scores = torch.cat([scores[:, :K], scores[:, K:].masked_fill(found[:, None], float("-inf"))], 1)
    target = torch.where(found, (top == labels[:, None]).double().argmax(1), K)
    sel_ce = torch.logsumexp(scores, -1) - scores.gather(1, target[:, None]).squeeze(1)
    return (weights64 * (ce + sel_ce)).sum()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_compiled_selector_loss_matches_float64(bf16):
    """fp32: the compiled CUDA chunk is the float64 function. bf16 autocast (training's precision):
    the candidates are a discrete choice made on the bf16 logits, so the reference takes the same
    ones; what remains is bf16 rounding, larger in the gradient than CE's alone (the selector's
    terms partly cancel)."""
    gen = torch.Generator().manual_seed(0)
    cfg = DraftModelConfig(hidden_size=H, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                           intermediate_size=1536, num_hidden_layers=1, vocab_size=V, block_size=B,
                           target_layer_ids=[1], num_target_layers=4, mask_token_id=3, family="dflash2",
                           conv_kernel_size=2, conv_group_size=64, selector_rank=64, selector_top_k=K)
    model = DFlash2DraftModel(cfg).cuda()
    with torch.no_grad():
        torch.nn.init.normal_(model.candidate_selector.successor_codebook, std=0.5)
        torch.nn.init.normal_(model.candidate_selector.predecessor_codebook, std=0.5)
    blocks = 2 * 2048 // B + 13  # three chunks of 2,048 rows, the last one padded
    hidden = torch.randn(1, blocks * B, H, generator=gen).cuda()
    head = (torch.randn(V, H, generator=gen) * 0.05).cuda()
    labels = torch.randint(0, V, hidden.shape[:2], generator=gen).cuda()
    block_ids = torch.randint(0, V, hidden.shape[:2], generator=gen).cuda()
    weights = torch.rand(hidden.shape[:2], generator=gen).cuda() * (torch.arange(blocks * B).cuda() % B != 0)
    h = hidden.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        inputs = selector_inputs(model, h, block_ids, labels, weights)
        out = block_loss(h, head, labels, weights, B, 2048, LossMix(selector=1.0), compiled=True, selector=inputs)
    out.weighted_ce_sum.backward()

    flat = hidden.reshape(-1, H)
    logits = (flat.bfloat16() @ head.bfloat16().t()).float() if bf16 else flat.double() @ head.double().t()
    top = tiled_top_k(logits, K)[1]
    h64 = flat.double().requires_grad_()
    slot = torch.arange(blocks * B).cuda() % B
    prev = torch.where(slot == 1, block_ids.roll(1, 1), labels.roll(1, 1)).reshape(-1)
    ref = selector_reference(h64, head.double(), labels.reshape(-1), prev, weights.double().reshape(-1),
                             model.candidate_selector, top)
    ref.backward()
    loss_rel = abs(float(out.weighted_ce_sum) - float(ref)) / abs(float(ref))
    grad_rel = float((h.grad.double().reshape(-1, H) - h64.grad).norm() / h64.grad.norm())
    assert loss_rel < (1e-2 if bf16 else 1e-5), loss_rel
    assert grad_rel < (5e-2 if bf16 else 1e-4), grad_rel


@pytest.mark.parametrize("family", [[], DFLASH2], ids=["dflash", "dflash2"])
def test_a_compiled_step_makes_no_host_sync(make_run_config, family):
    target = to_cuda(tiny_target(num_layers=4, hidden=64))
    trainer = Trainer(make_run_config(overrides=[*GPU_RECIPE, *family]), target=target)
    trainer.stepper.prepare()
    trainer.train_step()  # the first step fills the feature cache's bookkeeping
    with no_host_sync():
        trainer.train_step()
