"""Tiny random-init targets of every model family users train drafters for.

Each family keeps what makes it itself (MoE routing, sliding windows, sinks, soft-capping, scaled
embeddings, MLA, rope scaling) at a size that runs a whole chain in seconds on one CPU core. Windows
are shorter than the test's prompts plus answers, so the window matters.
"""

from __future__ import annotations

import torch
import transformers as tf

WINDOW = 8
"""Sliding window of the families that have one: below the matrix's prompt + answer lengths."""

_COMMON = dict(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.1)
_ALTERNATING = ["sliding_attention", "full_attention"] * 2


def _cfg(cls, drop=(), **overrides):
    kwargs = {k: v for k, v in _COMMON.items() if k not in drop} | overrides
    return getattr(tf, cls)(**kwargs)


FAMILIES = {
    # Llama 3.1's rope scaling (SmolLM2 is plain Llama)
    "llama3": lambda: _cfg("LlamaConfig", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": lambda: _cfg("Qwen2Config"),
    "qwen3": lambda: _cfg("Qwen3Config", head_dim=8),
    "qwen3-moe": lambda: _cfg("Qwen3MoeConfig", head_dim=8, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[]),
    "mistral": lambda: _cfg("MistralConfig", sliding_window=WINDOW, head_dim=8),
    "mixtral": lambda: _cfg("MixtralConfig", sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    "gemma2": lambda: _cfg("Gemma2Config", head_dim=8, sliding_window=WINDOW, layer_types=_ALTERNATING,
                           attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=8),
    # base model (no chat template) in the matrix: tests/test_families.py
    "gemma3": lambda: _cfg("Gemma3TextConfig", head_dim=8, sliding_window=WINDOW, layer_types=_ALTERNATING,
                           query_pre_attn_scalar=8),
    "gpt-oss": lambda: _cfg("GptOssConfig", head_dim=8, sliding_window=WINDOW, layer_types=_ALTERNATING,
                            num_local_experts=4, num_experts_per_tok=2),
    "glm4-moe": lambda: _cfg("Glm4MoeConfig", head_dim=8, moe_intermediate_size=32, n_routed_experts=4,
                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                             topk_group=1),
    "phi3": lambda: _cfg("Phi3Config", pad_token_id=0),
    "olmo2": lambda: _cfg("Olmo2Config"),
    # multi-head latent attention
    "deepseek-v3": lambda: _cfg("DeepseekV3Config", drop=("num_key_value_heads",), num_key_value_heads=4,
                                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                v_head_dim=8, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),
}


def tiny_model(family: str, seed: int = 0):
    """A random-init fp32 causal LM of `family` (eval mode, frozen)."""
    torch.manual_seed(seed)
    config = FAMILIES[family]()
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family == "gpt-oss":  # sinks start at zero: make them count, so a path that drops them differs
        for layer in model.model.layers:
            layer.self_attn.sinks.data.normal_(0, 1.0)
    return model.eval().requires_grad_(False)
