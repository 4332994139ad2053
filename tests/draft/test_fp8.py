"""FP8 training of the drafter (draft/fp8.py) on CPU, through torchao's emulation (the same casts
and scales, bf16 matmuls): which layers are swapped, state_dict keys unchanged, a step close to the
plain one; and the refusal where FP8 matmuls cannot run. The real kernels: tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from dflash_train.checks.fp8 import fp8_problem
from dflash_train.draft.fp8 import RECIPES, convert_to_fp8
from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig



needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="the fp8 extra (torchao) is not installed")


def _drafter(hidden: int = 64, intermediate: int = 128) -> DFlashDraftModel:
    torch.manual_seed(0)
    return DFlashDraftModel(DraftModelConfig(
        hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=intermediate, num_hidden_layers=2, vocab_size=256, block_size=4,
        target_layer_ids=[0, 2], num_target_layers=4, mask_token_id=255))


@pytest.mark.parametrize("recipe", RECIPES)
@needs_torchao
def test_each_linear_layer_is_swapped_and_the_state_dict_keeps_its_keys(recipe):
    from torchao.float8.float8_linear import Float8Linear

    plain, fp8 = _drafter(), _drafter()
    assert convert_to_fp8(fp8, recipe, emulate=True) == 1 + 2 * 7
    assert all(not isinstance(m, torch.nn.Linear) or isinstance(m, Float8Linear) for m in fp8.modules())
    assert list(fp8.state_dict()) == list(plain.state_dict())
    for (name, a), b in zip(plain.state_dict().items(), fp8.state_dict().values()):
        assert torch.equal(a, b), name


@needs_torchao
def test_a_layer_whose_width_the_kernels_cannot_take_stays_plain():
    from torchao.float8.float8_linear import Float8Linear

    drafter = _drafter(intermediate=120)  # 120 is not a multiple of 16: the three MLP matmuls stay
    assert convert_to_fp8(drafter, "rowwise", emulate=True) == 1 + 2 * 4
    assert not isinstance(drafter.layers[0].mlp.down_proj, Float8Linear)


@needs_torchao
def test_an_emulated_fp8_step_stays_close_to_the_plain_one():
    plain = _drafter()
    fp8 = copy.deepcopy(plain)
    convert_to_fp8(fp8, "rowwise", emulate=True)
    x = torch.randn(2, 32, 64)
    grads = []
    for model in (plain, fp8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.fc(x.repeat(1, 1, 2))
            out = model.layers[0].mlp(out)
        out.float().square().mean().backward()
        grads.append(model.fc.weight.grad)
    cosine = torch.nn.functional.cosine_similarity(grads[0].flatten(), grads[1].flatten(), dim=0)
    assert 0.97 < cosine < 1.0  # close, and not the plain path (it would give exactly 1)


def test_fp8_is_refused_where_it_cannot_run(monkeypatch):
    import dflash_train.checks.fp8 as check

    monkeypatch.setattr(check.importlib.util, "find_spec", lambda name: None)
    assert fp8_problem(torch.device("cpu")) == "FP8 needs torchao: pip install 'dflash-train[fp8]'"
    monkeypatch.setattr(check.importlib.util, "find_spec", lambda name: object())
    assert fp8_problem(torch.device("cpu")) == "FP8 matmuls need a CUDA GPU of compute capability >= 8.9 (the device is cpu)"


def test_train_refuses_fp8_on_cpu_before_the_target_loads(tmp_path, capsys):
    import json
    from pathlib import Path

    from dflash_train.cli import main

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    config = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    for key in ("draft.fp8=rowwise", "target.fp8=rowwise"):
        code = main(["train", "-c", str(config), f"run_dir={tmp_path}/run", "device=cpu", f"data.train_files=[{data}]", key])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        assert f"{key.split('=')[0]}=rowwise: FP8" in err.strip().splitlines()[-1], err


@needs_torchao
def test_an_unknown_recipe_is_refused():
    with pytest.raises(ValueError, match="draft.fp8: 'fast' is not one of off, tensorwise, rowwise"):
        convert_to_fp8(_drafter(), "fast", emulate=True)
