"""Decayed block cross-entropy through the target's LM head, in chunks, and acceptance metrics.

512 anchors x 16 slots x a 152K vocabulary would be 1.2G logits per sequence; the head is applied
to `chunk_size` query tokens at a time under activation checkpointing, so only one chunk of logits
ever exists, in the forward and in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_ce(h, lm_head_weight, labels, weights):
    logits = (h @ lm_head_weight.t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    correct = (logits.argmax(-1) == labels).float()
    return (ce * weights).sum(), correct


@dataclass
class BlockLoss:
    weighted_ce_sum: torch.Tensor
    """sum_k w_k * CE_k over this micro-batch: divide by the GLOBAL weight sum before backward."""
    correct_per_slot: torch.Tensor
    """[B] correct predictions per block slot (slot 0 always 0)."""
    counted_per_slot: torch.Tensor
    """[B] predictions that count per slot."""


def block_loss(
    hidden_BQH: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels_BQ: torch.Tensor,
    weights_BQ: torch.Tensor,
    block_size: int,
    chunk_size: int = 4096,
) -> BlockLoss:
    h = hidden_BQH.reshape(-1, hidden_BQH.shape[-1])
    labels, weights = labels_BQ.reshape(-1), weights_BQ.reshape(-1)
    total = h.new_zeros((), dtype=torch.float32)
    correct = []
    for start in range(0, h.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        if h.requires_grad:
            s, c = checkpoint(_chunk_ce, h[sl], lm_head_weight, labels[sl], weights[sl], use_reentrant=False)
        else:
            s, c = _chunk_ce(h[sl], lm_head_weight, labels[sl], weights[sl])
        total = total + s
        correct.append(c.detach())
    counted = (weights > 0).float()
    correct = torch.cat(correct) * counted
    return BlockLoss(
        weighted_ce_sum=total,
        correct_per_slot=correct.view(-1, block_size).sum(0),
        counted_per_slot=counted.view(-1, block_size).sum(0),
    )


def acceptance_metrics(correct_per_slot: torch.Tensor, counted_per_slot: torch.Tensor) -> dict:
    """Per-slot accuracy acc_k (k = 1..B-1) and tau_hat = 1 + sum_k prod_{j<=k} acc_j.

    tau_hat estimates tokens per block (incl. the bonus token) if slot errors were independent.
    """
    acc = (correct_per_slot[1:] / counted_per_slot[1:].clamp(min=1)).double().cpu()
    tau_hat = 1.0 + torch.cumprod(acc, 0).sum().item()
    return {"acc": [round(a, 5) for a in acc.tolist()], "tau_hat": tau_hat}
