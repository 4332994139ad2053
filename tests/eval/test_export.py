"""Export folder format (docs/design.md#export-format) and loading drafters back, from checkpoints and exports."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from dflash_train.eval.export import draft_config_from_export, export_drafter, load_drafter

from .tiny_models import tiny_drafter, tiny_target


def design_tensor_names(num_layers):
    """The tensor list as docs/design.md#export-format writes it."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return names


def save_checkpoint(drafter, path):
    path.mkdir()
    save_file(drafter.state_dict(), path / "model.safetensors")
    (path / "draft_config.json").write_text(json.dumps(drafter.config.to_dict()))
    return path


def draft_hidden(drafter, target, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = len(drafter.config.target_layer_ids)
    ctx = torch.randn(1, 7, k * target.hidden_size, generator=g)
    block = target.embed_weight[torch.randint(0, target.vocab_size, (4,), generator=g)][None]
    return drafter(ctx, block, torch.arange(7)[None], torch.arange(7, 11)[None])


@pytest.fixture
def trained(target, tmp_path):
    drafter = tiny_drafter(target, layer_ids=(0, 1, 3))
    for p in drafter.parameters():  # norms away from 1, so a norm mix-up would show
        p.data += 0.05 * torch.randn_like(p)
    return drafter, save_checkpoint(drafter, tmp_path / "ckpt")


def test_export_config_and_tensors(target, trained, tmp_path):
    drafter, ckpt = trained
    out = export_drafter(ckpt, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash.py", "model.safetensors"]
    c = json.loads((out / "config.json").read_text())
    cfg = drafter.config
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["block_size"] == cfg.block_size and c["num_target_layers"] == 4
    assert c["dflash_config"] == {"mask_token_id": cfg.mask_token_id, "target_layer_ids": [0, 1, 3]}
    assert c["layer_types"] == ["full_attention"] * cfg.num_hidden_layers
    assert c["tie_word_embeddings"] is False and c["attention_bias"] is False and c["hidden_act"] == "silu"
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size"):
        assert c[key] == getattr(cfg, key), key
    # What HF-based servers do first: parse it as a Qwen3 config.
    hf = AutoConfig.from_pretrained(out)
    assert hf.model_type == "qwen3" and hf.num_hidden_layers == cfg.num_hidden_layers

    weights = load_file(out / "model.safetensors")
    assert set(weights) == design_tensor_names(cfg.num_hidden_layers)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert weights["fc.weight"].shape == (64, 3 * 64)
    assert draft_config_from_export(out).to_dict() == cfg.to_dict()


def test_export_names_the_mask_token_for_sglang(trained, tmp_path):
    _, ckpt = trained
    out = export_drafter(ckpt, tmp_path / "export", mask_token="<|MASK|>")
    assert json.loads((out / "config.json").read_text())["dflash_config"]["mask_token"] == "<|MASK|>"


def test_load_gives_the_same_drafter(target, trained, tmp_path):
    drafter, ckpt = trained
    expected = draft_hidden(drafter, target)
    torch.testing.assert_close(draft_hidden(load_drafter(ckpt, target), target), expected, rtol=0, atol=0)

    out = export_drafter(ckpt, tmp_path / "export")
    exported = load_drafter(out, target)
    assert exported.fc.weight.dtype == target.embed_weight.dtype  # runs in the target's dtype
    rounded = tiny_drafter(target, layer_ids=(0, 1, 3))
    rounded.load_state_dict({k: v.bfloat16().float() for k, v in drafter.state_dict().items()})
    torch.testing.assert_close(draft_hidden(exported, target), draft_hidden(rounded, target), rtol=0, atol=0)
    torch.testing.assert_close(draft_hidden(exported, target), expected, rtol=0.05, atol=0.05)

    # SGLang's `model.` prefix is accepted too.
    prefixed = {f"model.{k}": v for k, v in load_file(out / "model.safetensors").items()}
    save_file(prefixed, out / "model.safetensors")
    torch.testing.assert_close(draft_hidden(load_drafter(out, target), target), draft_hidden(exported, target))


def test_export_replaces_an_existing_folder(trained, tmp_path):
    _, ckpt = trained
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    export_drafter(ckpt, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash.py", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "export"]  # no temp dirs left


@pytest.mark.parametrize(
    "other,message",
    [
        (dict(hidden_size=32), "drafter hidden_size=64, target hidden_size=32"),
        (dict(num_layers=6), "drafter num_target_layers=4, target num_target_layers=6"),
        (dict(vocab_size=128), "drafter vocab_size=256, target vocab_size=128"),
    ],
)
def test_mismatched_target_is_a_clear_error(trained, other, message):
    _, ckpt = trained
    with pytest.raises(ValueError, match=message):
        load_drafter(ckpt, tiny_target(**other))


def test_tensor_shapes_must_match_the_config(target, trained, tmp_path):
    drafter, ckpt = trained
    state = drafter.state_dict()
    state["fc.weight"] = state["fc.weight"][:, :128].contiguous()  # features of 2 layers, config says 3
    save_file(state, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"fc.weight has shape \[64, 128\], config implies \[64, 192\]"):
        load_drafter(ckpt, target)


def test_a_windowed_drafter_exports_the_keys_llama_cpp_reads(target, tmp_path):
    drafter = tiny_drafter(target, layer_ids=(0, 1, 3), sliding_window=6)
    out = export_drafter(save_checkpoint(drafter, tmp_path / "ckpt"), tmp_path / "export")
    c = json.loads((out / "config.json").read_text())
    assert (c["use_sliding_window"], c["sliding_window"]) == (True, 6)
    assert c["layer_types"] == ["sliding_attention"] * drafter.config.num_hidden_layers
    # conversion/qwen.py (DFlash): the window, and a pattern flag per layer from layer_types
    assert [t == "sliding_attention" for t in c["layer_types"]] == [True] * drafter.config.num_hidden_layers
    assert draft_config_from_export(out).to_dict() == drafter.config.to_dict()
    assert load_drafter(out, target).config.sliding_window == 6
    assert AutoConfig.from_pretrained(out).sliding_window == 6


def test_a_full_context_export_writes_no_window(trained, tmp_path):
    _, ckpt = trained
    c = json.loads((export_drafter(ckpt, tmp_path / "export") / "config.json").read_text())
    assert (c["use_sliding_window"], c["sliding_window"]) == (False, None)
