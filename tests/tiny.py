"""Tiny offline building blocks for tests: a byte-level ChatML tokenizer and random-init targets."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, GptOssForCausalLM, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast, Qwen3Config,
                          Qwen3ForCausalLM)

from dflash_train.targets.model import Target

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(chat_template: str = CHATML) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 256 byte tokens + 3 specials (vocab 259), no merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "pad_token": "<pad>"})
    fast.chat_template = chat_template
    return fast


_DEFAULT = object()


def tiny_target(
    num_layers: int = 4, hidden: int = 64, vocab: int = 272, seed: int = 0, tokenizer=_DEFAULT,
    initializer_range: float = 0.02, eager: bool = False, max_positions: int = 2048,
) -> Target:
    """A random Qwen3 target. A wide init (initializer_range 0.1) makes its next-token distributions
    peaked, like a real LM's; eager attention avoids CPU SDPA's thread spin-up on tiny shapes."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=max_positions,
        tie_word_embeddings=False, initializer_range=initializer_range,
    )
    if eager:
        config._attn_implementation = "eager"
    model = Qwen3ForCausalLM(config).eval().requires_grad_(False)
    tokenizer = tiny_tokenizer() if tokenizer is _DEFAULT else tokenizer
    return Target(model=model, tokenizer=tokenizer, name=f"tiny-qwen3-v{vocab}", device=torch.device("cpu"))


GPU_RECIPE = ["device=cuda", "target.dtype=bfloat16", "draft.attention=flex", "train.compile=true",
              "train.compile_loss=true", "data.length_bucket=32"]
"""Overrides of a tiny run config that train the way the GPU recipes do (a `to_cuda` target)."""
DFLASH2 = ["draft.family=dflash2", "objective.loss={ce: 1, selector: 1}", "draft.dflash2.conv_group_size=16",
           "draft.dflash2.selector_rank=8"]
"""Overrides of a tiny run config that train a DFlash2 drafter (sizes that fit a tiny target)."""


@contextmanager
def no_host_sync():
    """Inside, the first synchronising CUDA call raises (torch's sync debug mode "error")."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def to_cuda(target: Target, dtype: torch.dtype = torch.bfloat16) -> Target:
    """The target moved to the GPU, as `load_target` would give it there."""
    target.model.to("cuda", dtype)
    target.device = torch.device("cuda")
    target.__post_init__()  # the weight handles of the moved model
    return target


def tiny_llama(num_layers: int = 3, hidden: int = 32, vocab: int = 272, seed: int = 0) -> Target:
    """A random Llama target (SmolLM2's architecture): 4 heads, 2 KV heads, so it shards 2 ways."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    return Target(model=model, tokenizer=tiny_tokenizer(), name=f"tiny-llama-v{vocab}", device=torch.device("cpu"))


WINDOW = 8
"""The sliding window of the windowed tiny targets: shorter than their tests' prompts and answers."""


def tiny_windowed(family: str, hidden: int = 64, seed: int = 0) -> Target:
    """A random target whose layers slide: `mistral` (every layer, no layer_types), `gemma3`
    (sliding and full layers alternating, its own query scaling and local RoPE) or `gpt_oss` (a
    sliding and a full layer, MoE, attention sinks: made far from zero, so ignoring them changes the
    tokens). Peaked init and eager attention as tiny_target (gpt-oss has no SDPA in transformers).
    The vocabulary is `hidden` tokens: a square LM head, so a scripted drafter can propose any token."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=hidden, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, initializer_range=0.1,
                 tie_word_embeddings=False)
    alternating = ["sliding_attention", "full_attention"] * 2
    if family == "mistral":
        config = MistralConfig(num_hidden_layers=2, **shape)
        model = MistralForCausalLM(config)
    elif family == "gemma3":
        config = Gemma3TextConfig(num_hidden_layers=4, layer_types=alternating, query_pre_attn_scalar=16, **shape)
        model = Gemma3ForCausalLM(config)
    elif family == "gpt_oss":
        config = GptOssConfig(num_hidden_layers=2, layer_types=alternating[:2], num_local_experts=4,
                              num_experts_per_tok=2, **shape)
        model = GptOssForCausalLM(config)
        for layer in model.model.layers:
            layer.self_attn.sinks.data = 3 * torch.randn(config.num_attention_heads)
    else:
        raise ValueError(family)
    model.config._attn_implementation = "eager"
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, name=f"tiny-{family}", device=torch.device("cpu"))
