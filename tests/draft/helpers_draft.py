"""Small drafter configs shared by the draft tests (no target, no pydantic: also imported on GPU)."""

from __future__ import annotations

import torch

from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig


def tiny_draft_config(**overrides) -> DraftModelConfig:
    kw = dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        num_hidden_layers=2, vocab_size=61, block_size=4, target_layer_ids=[0, 2], num_target_layers=4,
        mask_token_id=60,
    )
    kw.update(overrides)
    return DraftModelConfig(**kw)


def tiny_drafter(seed: int = 0, **overrides) -> DFlashDraftModel:
    torch.manual_seed(seed)
    return DFlashDraftModel(tiny_draft_config(**overrides)).eval()
