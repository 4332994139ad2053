"""Tiny random drafters (and eval's flavour of tests/tiny.py's target)."""

import torch
from tiny import tiny_target as _tiny_target

from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig
from dflash_train.targets.model import Target


def tiny_target(vocab_size: int = 256, num_layers: int = 4, hidden_size: int = 64, seed: int = 0, tokenizer=None,
                max_positions: int = 2048):
    """Eval's tiny target: peaked distributions (so drafts sometimes match), no tokenizer needed."""
    return _tiny_target(num_layers, hidden_size, vocab_size, seed, tokenizer, initializer_range=0.1, eager=True,
                        max_positions=max_positions)


def tiny_drafter(target: Target, block_size: int = 4, layer_ids=(0, 2), num_layers: int = 2, seed: int = 1,
                 sliding_window: int | None = None):
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
        sliding_window=sliding_window,
    )
    return DFlashDraftModel(cfg).eval().requires_grad_(False)
