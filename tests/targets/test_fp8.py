"""The target's FP8 quantisation (targets/fp8.py) leaves torch.compile's process-wide settings as
they were, where torchao's default would turn coordinate-descent tuning on for every graph the
process compiles later; and with tensorwise scales a token's output depends on its batch.

Through the real torchao on CPU where it is installed (not in CI): torchao checks for an FP8 GPU
before it quantises, so those tests tell it one is there (its CPU path quantises the same way). In
CI, one test checks what `quantize_decoder` asks torchao for, with torchao's two names standing in.
The real kernels: tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
import torch._inductor.config as inductor_config
from torch import nn

import dflash_train.targets.fp8 as target_fp8
from dflash_train.checks.compile_settings import compile_settings_kept
from dflash_train.errors import UserError

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="the fp8 extra (torchao) is not installed")


@pytest.fixture
def fp8_gpu_claimed(monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)  # torchao's hardware check passes
    monkeypatch.setattr(target_fp8, "fp8_problem", lambda device: None)  # ours too
    saved = inductor_config.get_config_copy()
    yield
    inductor_config.load_config(saved)  # whatever torchao's default set, the next test starts clean


def _layers() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList([nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 24))]).to(torch.bfloat16)


def test_quantize_decoder_asks_torchao_to_leave_inductor_alone(monkeypatch):
    asked = []

    class Config:  # torchao's config class: what quantize_decoder passes it
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    quantization = types.ModuleType("torchao.quantization")
    quantization.Float8DynamicActivationFloat8WeightConfig = Config
    quantization.PerRow = quantization.PerTensor = object
    quantization.quantize_ = lambda layers, config, filter_fn: asked.append(config.kwargs)
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.quantization", quantization)
    monkeypatch.setattr(target_fp8, "fp8_problem", lambda device: None)
    assert target_fp8.quantize_decoder(_layers(), "tensorwise") == 2
    assert len(asked) == 1 and asked[0]["set_inductor_config"] is False


@needs_torchao
@pytest.mark.parametrize("granularity", target_fp8.GRANULARITIES)
def test_quantising_the_target_leaves_compile_settings_alone(fp8_gpu_claimed, granularity):
    from torchao.quantization import Float8Tensor

    layers = _layers()
    before = inductor_config.get_config_copy()
    assert target_fp8.quantize_decoder(layers, granularity) == 2  # 64 x 24 is not FP8-shaped
    assert inductor_config.get_config_copy() == before
    assert isinstance(layers[0][0].weight, Float8Tensor) and not isinstance(layers[0][2].weight, Float8Tensor)


@needs_torchao
def test_torchaos_default_would_have_turned_tuning_on(fp8_gpu_claimed):
    """The reference for the test above: the same quantisation with torchao's default settings is
    caught by the guard (if torchao stops changing them, this test says so)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerTensor, quantize_

    with inductor_config.patch(coordinate_descent_tuning=False):
        with pytest.raises(UserError, match="coordinate_descent_tuning: False -> True"):
            with compile_settings_kept("torchao's default"):
                quantize_(_layers(), Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()))


@needs_torchao
@pytest.mark.parametrize("granularity", target_fp8.GRANULARITIES)
def test_only_rowwise_scales_keep_a_tokens_output_independent_of_its_batch(fp8_gpu_claimed, granularity):
    """Why an eval against a `target.fp8=tensorwise` target fails its lossless check: one scale for
    a whole activation tensor makes a token's output depend on the other tokens in the pass (a
    verification block against a one-token step). Per-row scales leave it to the token alone."""
    layers = _layers()
    target_fp8.quantize_decoder(layers, granularity)
    token = torch.randn(1, 64, dtype=torch.bfloat16)
    louder = 8 * torch.randn(1, 64, dtype=torch.bfloat16)  # a neighbour with a larger range
    alone, beside = layers[0](token), layers[0](torch.cat([token, louder]))[:1]
    if granularity == "rowwise":
        assert torch.equal(alone, beside)
    else:
        assert (alone.float() - beside.float()).abs().max() > 0.01
