"""Tiny random targets built from a config (no download) and drafters."""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig
from dflash_train.target import Target


def tiny_target(
    vocab_size: int = 256, num_layers: int = 4, hidden_size: int = 64, seed: int = 0, tokenizer=None
) -> Target:
    """A random Qwen3 target. A wide init makes its next-token distributions peaked, like a real LM's."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    # Eager attention: CPU SDPA's causal kernel spins threads for tiny shapes (~3 ms a call on 2 busy cores).
    config._attn_implementation = "eager"
    model = Qwen3ForCausalLM(config).eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, name=f"tiny-qwen3-v{vocab_size}", device=torch.device("cpu"))


def tiny_drafter(target: Target, block_size: int = 4, layer_ids=(0, 2), num_layers: int = 2, seed: int = 1):
    torch.manual_seed(seed)
    cfg = DraftModelConfig(
        hidden_size=target.hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=2 * target.hidden_size,
        num_hidden_layers=num_layers,
        vocab_size=target.vocab_size,
        block_size=block_size,
        target_layer_ids=list(layer_ids),
        num_target_layers=target.num_layers,
        mask_token_id=target.vocab_size - 1,
    )
    return DFlashDraftModel(cfg).eval().requires_grad_(False)
