"""A low-rank bias on each row's logits, trained inside the chunked LM-head pass (draft/loss.py).

DSpark's Markov head (draft/dspark.py) adds `code_r . proj[v]` to row r's logit of token v: `code`
[rows, R] is the code of the row's previous token, `proj` [V, R] projects it onto the vocabulary.
The chunk forms the biased logits, and with the closed-form gradient of its loss in them (`dlogits`,
the rows already weighted) also the bias's:
  d / d code_r  = dlogits_r @ proj          (per row: the backward scales it by the row's gradient)
  d / d proj    = dlogits^T @ code          (summed over the chunk's rows)
The second is a sum over rows, so the backward can only scale it as a whole: exact because the chunk's
terms reach the loss as a plain sum (every row's upstream gradient is the same scalar); the D-PACE slot
weights, which differ per row, are refused with a bias (`block_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogitBias:
    """What the chunked pass needs of a logit bias, per query row of the loss."""

    code: torch.Tensor
    """[rows, R] each row's code (differentiable: what forms it learns through it)."""
    proj: torch.Tensor
    """[V, R] the projection onto the vocabulary (a parameter)."""


def biased(logits: torch.Tensor, code: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """`logits` [n, V] (fp32) plus each row's bias, formed in their dtype."""
    return logits + code.to(logits.dtype) @ proj.to(logits.dtype).t()


def bias_grads(dlogits: torch.Tensor, code: torch.Tensor, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d loss / d code [n, R], d loss / d proj [V, R]) from the chunk's weighted `dlogits` [n, V]."""
    return dlogits @ proj.to(dlogits.dtype), dlogits.t() @ code.to(dlogits.dtype)
