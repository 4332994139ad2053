"""DFlash2's path-selector loss, scored inside the chunked LM-head pass (draft/loss.py).

The selector chooses each slot's token among the top-k candidates of the draft logits, scoring
candidate c after predecessor q as `logit(c) + (predecessor[q] * gate) . successor[c]`
(draft/dflash2.py). Its loss needs each row's top-k ids and their logits, which the chunked pass
forms anyway: the chunk takes them there, so no second LM-head product and no full-vocabulary
tensor outlives the chunk. Rows are never selected by a data-dependent index (which would cost a
host sync on a GPU): rows that do not count carry weight 0.

Acceptance stops at the first miss, so a slot's choice matters only when every slot before it was
right: its predecessor is the true previous token (the block's given token for slot 1), as the
engines' greedy walk conditions it at decode time. So the training statistic "the selector picks
the checked token after the true predecessor" is what a greedy round accepts, slot by slot.

The per-row loss is CE over the candidates; with `join`, a checked token outside the top-k joins
them as one more candidate (every counted slot teaches the drafter to rank it first: ours and
speculators'); with `skip` such a slot gives no selector loss (SpecForge's strict top-k). Its
gradient is closed-form, d CE / d scores = softmax(scores) - onehot(target), which reaches:
  the hidden states   through the candidates' logits: sum_c ds_c * W[id_c]  (k+1 rows of the head;
                      where the selector's row scale is the CE's, ds joins the logits' gradient at id_c
                      and the head's one product carries both)
  the gate            sum_c ds_c * successor[id_c]
  the successor rows  ds_c * gate, added at id_c
`selector_backward` forms these from the chunk's saved ids and score gradients, so the forward keeps
[rows, k+1] numbers per chunk, not [rows, V].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_train.draft.vocab_tiles import tiled_top_k


@dataclass
class SelectorInputs:
    """What the chunked pass needs of a DFlash2 drafter's selector, per query row of the loss."""

    gate: torch.Tensor
    """[rows, R] the predecessor code of each row's true previous token times the gate of its hidden
    state (differentiable: the codebook and the hidden projection learn through it)."""
    successor: torch.Tensor
    """[V, R] the successor codebook (a parameter)."""
    weights: torch.Tensor
    """[rows] each row's selector weight (0: no loss)."""
    top_k: int


def selector_chunk(logits: torch.Tensor, reference: torch.Tensor, gate: torch.Tensor, successor: torch.Tensor,
                   weights: torch.Tensor, top_k: int, join: bool, tile_max: torch.Tensor | None = None):
    """One chunk's selector, from its fp32 logits [n, V] (and their tile maxima, draft/vocab_tiles.py,
    where the chunk formed them) and checked tokens [n]: ([n] weighted CE,
    [n] 1.0 where the selector's pick after the true predecessor is the checked token, [n, k+1] the
    weighted gradient of the loss in the scores, [n, k+1] the candidates' ids)."""
    with torch.no_grad():
        top_logits, top = tiled_top_k(logits, top_k, tile_max)
    in_top = top == reference[:, None]
    found = in_top.any(1)
    ids = torch.cat([top, reference[:, None]], dim=1)
    unary = torch.cat([top_logits, logits.gather(1, reference[:, None])], dim=1)
    pair = (gate.float()[:, None, :] * successor[ids].float()).sum(-1)
    scores = unary + pair
    # the checked token once: its own column only when it is not already a candidate
    scores = torch.cat([scores[:, :top_k], scores[:, top_k:].masked_fill(found[:, None], float("-inf"))], dim=1)
    target = torch.where(found, in_top.float().argmax(1), top_k)
    if not join:
        weights = weights * found
    log_p = F.log_softmax(scores, dim=-1)
    terms = -log_p.gather(1, target[:, None]).squeeze(1) * weights
    pick = top.gather(1, scores[:, :top_k].argmax(1, keepdim=True)).squeeze(1)
    correct = (pick == reference).float()
    dscores = (log_p.exp() - F.one_hot(target, top_k + 1).float()) * weights[:, None]
    return terms, correct, dscores, ids


def selector_backward(head: torch.Tensor, successor: torch.Tensor, gate: torch.Tensor, ids: torch.Tensor,
                      dscores: torch.Tensor, grad_terms: torch.Tensor, with_hidden: bool = True):
    """The gradients of a chunk's selector terms (scaled by `grad_terms` [n]) in the hidden states
    [n, H] (None without `with_hidden`: the chunk added the score gradients to its logits' gradient,
    which the head's product takes to the hidden states), the gate [n, R] and the successor codebook [V, R]."""
    ds = (dscores * grad_terms[:, None]).float()
    grad_h = torch.bmm(ds[:, None, :].to(head.dtype), head[ids]).squeeze(1) if with_hidden else None
    grad_gate = torch.bmm(ds[:, None, :], successor[ids].float()).squeeze(1)
    rows = (ds[..., None] * gate.float()[:, None, :]).flatten(0, 1)
    grad_successor = torch.zeros(successor.shape, dtype=torch.float32, device=successor.device)
    grad_successor.index_add_(0, ids.flatten(), rows)
    return grad_h, grad_gate.to(gate.dtype), grad_successor.to(successor.dtype)
