"""The converted embedded targets load the same in transformers 4.x, which serving stacks pin."""

from __future__ import annotations

import json

from tiny import tiny_tokenizer
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dflash_train.targets.embedded import FAST_TOKENIZER, legacy_fields, legacy_rope_fields


def test_rope_settings_are_written_where_transformers_4_reads_them():
    assert legacy_rope_fields({"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}) == {
        "rope_theta": 100000.0}
    llama3 = {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}
    assert legacy_rope_fields({"rope_parameters": llama3}) == {
        "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    gemma3 = {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
              "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}
    assert legacy_rope_fields({"rope_parameters": gemma3}) == {"rope_theta": 1e6, "rope_local_base_freq": 1e4}


def test_a_converted_directory_names_a_tokenizer_class_both_versions_know(tmp_path):
    """SmolLM2's rope base is 1e5: a 4.x reader given no rope_theta would silently take 1e4."""
    config = LlamaConfig(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, rope_parameters={"rope_theta": 100000.0,
                                                                                      "rope_type": "default"})
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    legacy_fields(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_theta"] == 100000.0 and saved["rope_parameters"]["rope_theta"] == 100000.0
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == FAST_TOKENIZER
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>user\nhello there<|im_end|>"
    assert again(text)["input_ids"] == tok(text)["input_ids"] and again.chat_template == tok.chat_template
