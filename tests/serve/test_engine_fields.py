"""Our export against what the serving engines' DFlash loaders read (docs/serving.md has the list, read
from the source of SGLang 0.5.23, vLLM 0.33.0 and llama.cpp 11434 on 2026-12-05). Every field a loader
needs is present with the meaning it gives it, and every weight lands on a loader parameter: SGLang
and vLLM skip a weight they have no parameter for without a word. llama.cpp's converter refuses a
name it cannot map, so tests/serve/test_check.py covers its names by converting and serving."""

from __future__ import annotations

import re

import pytest
import torch

from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig
from dflash_train.eval.export import export_config

# config.json fields each loader reads for a Qwen3-backbone DFlash drafter and has no default for, or
# whose default would be wrong for ours (top level unless dotted)
READ_BY = {
    "sglang": ["architectures", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta",
               "max_position_embeddings", "hidden_act", "layer_types", "block_size", "num_target_layers",
               "dflash_config.target_layer_ids", "dflash_config.mask_token", "dflash_config.mask_token_id"],
    "vllm": ["architectures", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta",
             "max_position_embeddings", "hidden_act", "layer_types", "block_size",
             "eagle_aux_hidden_state_layer_ids", "dflash_config.target_layer_ids", "dflash_config.mask_token_id"],
    "llama.cpp": ["architectures", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta",
                  "max_position_embeddings", "hidden_act", "block_size", "use_sliding_window",
                  "dflash_config.target_layer_ids", "dflash_config.mask_token_id"],
}
# SGLang and vLLM fuse q/k/v and gate/up on load; every other name is the parameter's own
FUSED = {"self_attn.q_proj": "self_attn.qkv_proj", "self_attn.k_proj": "self_attn.qkv_proj",
         "self_attn.v_proj": "self_attn.qkv_proj", "mlp.gate_proj": "mlp.gate_up_proj",
         "mlp.up_proj": "mlp.gate_up_proj"}
LOADER_PARAMETERS = ["fc.weight", "hidden_norm.weight", "norm.weight", r"layers\.\d+\.input_layernorm\.weight",
                     r"layers\.\d+\.post_attention_layernorm\.weight", r"layers\.\d+\.self_attn\.qkv_proj\.weight",
                     r"layers\.\d+\.self_attn\.o_proj\.weight", r"layers\.\d+\.self_attn\.[qk]_norm\.weight",
                     r"layers\.\d+\.mlp\.gate_up_proj\.weight", r"layers\.\d+\.mlp\.down_proj\.weight"]


@pytest.fixture
def cfg():
    return DraftModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            intermediate_size=96, num_hidden_layers=2, vocab_size=300, block_size=16,
                            target_layer_ids=[1, 3, 5], num_target_layers=8, mask_token_id=7)


def field(config: dict, dotted: str):
    value = config
    for part in dotted.split("."):
        assert part in value, f"export config.json has no {dotted}"
        value = value[part]
    return value


@pytest.mark.parametrize("engine", sorted(READ_BY))
def test_every_field_the_loader_reads_is_in_the_export(cfg, engine):
    config = export_config(cfg, mask_token="<mask>")
    for name in READ_BY[engine]:
        assert field(config, name) is not None, f"{engine} reads {name}"


def test_the_fields_mean_what_the_loaders_take_them_for(cfg):
    config = export_config(cfg, mask_token="<mask>")
    assert config["architectures"] == ["DFlashDraftModel"]
    # vLLM and llama.cpp capture the inputs of layers: our layer outputs, one later
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert config["dflash_config"]["mask_token_id"] == 7 and config["dflash_config"]["mask_token"] == "<mask>"
    assert config["layer_types"] == ["full_attention"] * 2 and config["use_sliding_window"] is False
    assert config["block_size"] == 16 and config["num_target_layers"] == 8


def test_every_weight_lands_on_a_loader_parameter(cfg):
    with torch.device("meta"):
        names = DFlashDraftModel(cfg).state_dict()
    for name in names:
        loaded = name
        for ours, fused in FUSED.items():
            loaded = loaded.replace(f".{ours}.", f".{fused}.")
        assert any(re.fullmatch(p, loaded) for p in LOADER_PARAMETERS), f"{name}: no loader parameter, dropped"
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)  # shared with the target

