"""The floating-point operations of one benchmark step, the numerator of MFU: every matmul counted
with the tokens it runs over, and attention over the (query, key) pairs its mask lets attend.

Target (forward only): each decoder layer's linear layers, 2 x weights x tokens, and causal attention,
4 x heads x head_dim x l(l+1)/2 a layer for a sequence of l tokens (QK^T and PV).
Drafter (forward and backward, x3): its layers' linear layers over the block tokens, their k and v
projections also over the context tokens (a block attends to the target's features); the context
projection `fc` over the context tokens (forward and weight gradient only: its input, the target's
features, needs no gradient); the frozen LM head over the block tokens (logits and the hidden
states' gradient); attention over the pairs of `masks.attended_pairs`, 4 x heads x head_dim a pair
and layer. Padding tokens count nothing; blocks of padded anchors count as they run.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_train.draft import masks

_CONTEXT_TOO = ("k_proj", "v_proj")  # a DFlash layer's keys and values cover the context and the block


def target_flops(decoder_layers: nn.ModuleList, config, lengths: list[int], layers_run: int) -> dict[str, int]:
    """The forward of the first `layers_run` decoder layers (the feature capture stops after the last
    layer it reads) over sequences of `lengths` tokens."""
    run = decoder_layers[:layers_run]
    weights = sum(m.weight.numel() for m in run.modules() if isinstance(m, nn.Linear))
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    width = config.num_attention_heads * config.head_dim
    return {"linear": 2 * weights * sum(lengths), "attention": 4 * width * pairs * layers_run}


def drafter_flops(drafter: nn.Module, anchors: torch.Tensor, context_tokens: int, context_len: int,
                  vocab_size: int, target_head: bool = False) -> dict[str, int]:
    """`target_head`: the loss distils from the target, whose head forms logits for every block token."""
    cfg = drafter.config
    block_tokens = anchors.numel() * cfg.block_size
    linear = 0
    for name, m in drafter.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        if m is drafter.fc:
            linear += 2 * 2 * m.weight.numel() * context_tokens
        else:
            tokens = block_tokens + (context_tokens if name.endswith(_CONTEXT_TOO) else 0)
            linear += 3 * 2 * m.weight.numel() * tokens
    pairs = masks.attended_pairs(anchors, cfg.block_size, context_len, cfg.sliding_window)
    attention = 3 * 4 * cfg.num_attention_heads * cfg.head_dim * pairs * cfg.num_hidden_layers
    head = 2 * cfg.hidden_size * vocab_size * block_tokens
    return {"linear": linear, "attention": attention, "lm_head": 2 * head + (head if target_head else 0)}
