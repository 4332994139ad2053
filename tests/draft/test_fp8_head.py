"""The loss's FP8 head (draft/fp8_head.py, `train.fp8_lm_head`) on CPU, where torch runs
`_scaled_mm` too: its matmuls against float64 products of the dequantised operands (what the
kernel computes, to bf16 rounding), the loss and gradient against the plain head's float64
reference (to FP8's error), and the refusals. On the FP8 tensor cores: tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_train.draft.fp8_head import E4M3_MAX, Fp8Head, quantise
from dflash_train.draft.loss import LossMix, block_loss

H, V, B = 32, 96, 4


def _dequantised(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double()


def test_quantise_keeps_each_row_within_e4m3s_precision():
    x = torch.randn(8, H, dtype=torch.float64) * torch.logspace(-3, 3, 8, dtype=torch.float64)[:, None]
    q, scale = quantise(x, dim=1)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (8, 1)
    assert torch.equal(q.float().abs().amax(1), torch.full((8,), E4M3_MAX))  # each row's largest maps to 448
    back = _dequantised(q, scale)
    # e4m3 keeps 3 mantissa bits: normal values within 2^-4 relative; below 2^-6 of 448 the step is fixed
    bound = torch.maximum(x.abs() * 2.0**-4, scale.double() * 2.0**-9)
    assert ((back - x).abs() <= bound).all()


def test_the_heads_matmuls_are_the_dequantised_products():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=gen, dtype=torch.bfloat16)
    h = torch.randn(21, H, generator=gen)  # 21 rows: padded to 32 inside, the padding cut again
    dlogits = torch.randn(21, V, generator=gen) * 1e-3
    head = Fp8Head(weight)
    a, sa = quantise(h, dim=1)
    want = _dequantised(a, sa) @ _dequantised(head.rows, head.row_scale).t()
    torch.testing.assert_close(head.logits(h).double(), want, rtol=8e-3, atol=1e-6)  # bf16 output
    g, sg = quantise(dlogits, dim=1)
    want = _dequantised(g, sg) @ _dequantised(head.cols_t.t(), head.col_scale)
    got = head.input_grad(dlogits)
    assert got.shape == (21, H) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=1e-9)


def test_block_loss_through_the_fp8_head_stays_close_to_the_plain_heads():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 8 * B, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.3
    labels = torch.randint(0, V, (2, 8 * B), generator=gen)
    weights = torch.rand(2, 8 * B, generator=gen)
    mix = LossMix(ce=0.5, kl=0.5, temperature=2.0)
    t_hidden, t_head = torch.randn(hidden.shape, generator=gen), torch.randn(V, H, generator=gen) * 0.3
    outs, grads = [], []
    for head in (weight.double(), Fp8Head(weight.bfloat16())):
        h = (hidden.double() if isinstance(head, torch.Tensor) else hidden).clone().requires_grad_()
        out = block_loss(h, head, labels, weights, B, 24, mix, t_hidden.to(h.dtype), lambda x: x @ t_head.to(x.dtype).t())
        out.weighted_ce_sum.backward()
        outs.append(out.weighted_ce_sum.item())
        grads.append(h.grad.double())
    assert outs[1] == pytest.approx(outs[0], rel=0.02)
    cosine = torch.nn.functional.cosine_similarity(grads[1].flatten(), grads[0].flatten(), dim=0)
    assert 0.99 < cosine < 1.0  # close, and not the plain head's gradient (it would give exactly 1)


def test_a_head_the_kernels_cannot_take_is_refused():
    with pytest.raises(ValueError, match="divisible by 16; it is 100 x 32"):
        Fp8Head(torch.randn(100, 32))


def test_fp8_head_is_refused_with_a_fused_kernel():
    from dflash_train.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="train.fp8_lm_head is for the chunked loss"):
        build_config({"train": {"fp8_lm_head": True, "ce_kernel": "liger"}})


def test_train_refuses_the_fp8_head_on_cpu_before_the_target_loads(tmp_path, capsys):
    from dflash_train.cli import main

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    config = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    code = main(["train", "-c", str(config), f"run_dir={tmp_path}/run", "device=cpu", f"data.train_files=[{data}]",
                 "train.fp8_lm_head=true"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "train.fp8_lm_head: FP8 matmuls need a CUDA GPU" in err.strip().splitlines()[-1], err


def test_the_runs_forward_carries_the_fp8_head(shared_tiny_target, make_run_config):
    """train.fp8_lm_head reaches the loss: DraftForward quantises the target's head once, and its
    loss on a batch is the FP8 head's, close to but not the plain head's."""
    from dflash_train.draft.model import DFlashDraftModel
    from dflash_train.draft.objective import make_task
    from dflash_train.train.forward import DraftForward
    from dflash_train.train.shapes import draft_model_config

    target = shared_tiny_target
    losses = []
    for fp8 in (False, True):
        cfg = make_run_config(overrides=[f"train.fp8_lm_head={str(fp8).lower()}"])
        torch.manual_seed(0)
        drafter = DFlashDraftModel(draft_model_config(cfg, target))
        forward = DraftForward.for_run(cfg, drafter, target, torch.device("cpu"), use_flex=False)
        assert isinstance(forward.fp8_head, Fp8Head) == fp8
        ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
        task = make_task(ids, torch.ones_like(ids, dtype=torch.bool), cfg.objective, 0)
        losses.append(forward(task, target.features(ids, [0, 2])).weighted_ce_sum.item())
    assert losses[1] != losses[0] and losses[1] == pytest.approx(losses[0], rel=0.02)
