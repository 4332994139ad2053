"""Decayed block loss through the target's LM head, in chunks, and acceptance metrics.

512 anchors x 16 slots x a 152K vocabulary would be 1.2G logits per sequence; the head is applied
to `chunk_size` query tokens at a time, and each chunk forms its gradient for the hidden states in
closed form while its logits exist. So only one chunk of logits ever exists, and none is formed
twice (a checkpointed chunk would form them again in the backward: three head matmuls, not two).
The same holds for the target's logits when the loss distils from the target: its final hidden states at the label positions travel with the
drafter's, and each chunk applies the target's head to its own rows only.

The per-slot loss is a weighted mix (`objective.loss`):
  ce            CE(q, data token)
  target_argmax CE(q, argmax p)            p: the target's next-token distribution at that position
  kl            T^2 KL(p_T || q_T)         both softened by the temperature T
  l1            sum_v |q_v - p_v|          twice the total variation: 1 - L1/2 is the acceptance
                                           probability of rejection sampling (SpecForge's DSpark recipe)
Each slot's loss is weighted by the task's weights (the decay, and 0 where a slot does not count), and
with D-PACE (`objective.slot_weights: dpace`) also by `dpace_weights`, formed here from the drafter's
own probabilities once every chunk of the blocks has run. A DFlash2 drafter's path selector is scored
in the same chunks, from the logits they form (draft/selector_loss.py); a DSpark drafter's Markov
head biases those logits first (draft/logit_bias.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from dflash_train.draft.acceptance import BlockLoss, block_statistics
from dflash_train.draft.column_updates import add_at
from dflash_train.draft.fused_ce import fused_ce
from dflash_train.draft.logit_bias import LogitBias, bias_grads, biased
from dflash_train.draft.selector_loss import SelectorInputs, selector_backward, selector_chunk
from dflash_train.draft.vocab_tiles import log_softmax, row_argmax


@dataclass(frozen=True)
class LossMix:
    ce: float = 1.0
    target_argmax: float = 0.0
    kl: float = 0.0
    temperature: float = 1.0
    l1: float = 0.0
    selector: float = 0.0
    confidence: float = 0.0
    """DSpark's confidence head: BCE against each slot's greedy acceptance (`block_loss`'s `confidence`)."""
    """DFlash2's path selector (draft/selector_loss.py), scored in the same chunked pass."""
    selector_join: bool = True
    """A checked token outside the selector's top-k joins the candidates (else: no selector loss there)."""
    selector_slot_weighted: bool = True
    """The selector term weighted as the slot's CE (decay or D-PACE); else 1 per counted slot."""
    dpace_alpha: float | None = None
    """Slots weighted by D-PACE with this smoothing (`dpace_weights`) instead of the mask's weights
    alone; None: off."""

    @classmethod
    def from_weights(cls, weights: dict, temperature: float = 1.0, dpace_alpha: float | None = None,
                     selector_join: bool = True, selector_slot_weighted: bool = True) -> LossMix:
        return cls(ce=weights.get("ce", 0.0), target_argmax=weights.get("target_argmax", 0.0),
                   kl=weights.get("kl", 0.0), temperature=temperature, l1=weights.get("l1", 0.0),
                   selector=weights.get("selector", 0.0), confidence=weights.get("confidence", 0.0),
                   dpace_alpha=dpace_alpha, selector_join=selector_join, selector_slot_weighted=selector_slot_weighted)

    @property
    def needs_target(self) -> bool:
        return self.target_argmax > 0 or self.kl > 0 or self.l1 > 0

    @property
    def selector_shares_row_scale(self) -> bool:
        """Whether each row's selector term reaches the total with the row's CE scale (so the backward
        scales both alike): always, but with D-PACE on the CE alone."""
        return self.dpace_alpha is None or self.selector_slot_weighted


def _logits(head, h: torch.Tensor) -> torch.Tensor:
    """fp32 logits of `h` [rows, H] through the frozen head: a weight [V, H] (a matmul in its dtype,
    as autocast runs it) or an `Fp8Head`."""
    if isinstance(head, torch.Tensor):
        return (h.to(head.dtype) @ head.t()).float()
    return head.logits(h)


def _input_grad(head, dlogits: torch.Tensor) -> torch.Tensor:
    """The gradient `dlogits` [rows, V] passes back to the hidden states: dlogits @ W."""
    if isinstance(head, torch.Tensor):
        return dlogits.to(head.dtype) @ head
    return head.input_grad(dlogits)


def _chunk_loss(h, head, labels, weights, target_h, target_logits_fn, mix: LossMix, with_grad: bool,
                sel_gate=None, successor=None, sel_weights=None, top_k: int = 0, bias_code=None, bias_proj=None):
    """([rows] weighted per-row losses, [rows] 1.0 where the drafted token is right, [rows] the
    drafter's probability of the token acceptance checks, d loss_row / d h of each row or None,
    with a selector (`top_k` > 0) its ([rows] weighted losses, score gradients, candidate ids), else None,
    and with a logit bias (`bias_code`) the gradients in its code and projection, else None).

    The drafted token is the argmax, or with a selector its pick after the true predecessor.

    The gradient is formed here, in closed form, while the chunk's logits exist; autograd would have
    to form them again in the backward (the recompute of a checkpoint: a third head matmul).
      d CE(z, y) / dz             = softmax(z) - onehot(y)
      d T^2 KL(p_T || q_T) / dz   = T (softmax(z / T) - p_T)
      d sum_v |q_v - p_v| / dz    = q (s - <s, q>),  s = sign(q - p)"""
    logits = _logits(head, h)
    if bias_code is not None:
        logits = biased(logits, bias_code, bias_proj)
    log_q, tile_max = log_softmax(logits)
    per_row = logits.new_zeros(logits.shape[0])
    reference = labels
    p_t = None
    if mix.ce:
        per_row = per_row - mix.ce * log_q.gather(1, labels[:, None]).squeeze(1)
    if target_h is not None:
        with torch.no_grad():
            t_logits = target_logits_fn(target_h).float()
        reference = t_logits.argmax(-1)  # acceptance is agreement with the target's own choice
        if mix.target_argmax:
            per_row = per_row - mix.target_argmax * log_q.gather(1, reference[:, None]).squeeze(1)
        if mix.kl:
            t = mix.temperature
            log_p = F.log_softmax(t_logits / t, dim=-1)
            p_t = log_p.exp()  # read again by the gradient
            log_q_t = log_q if t == 1 else F.log_softmax(logits / t, dim=-1)
            per_row = per_row + mix.kl * (t * t) * (p_t * (log_p - log_q_t)).sum(-1)
        if mix.l1:
            q = log_q.exp()
            diff = q - F.softmax(t_logits, dim=-1)
            sign = diff.sign()  # read again by the gradient
            per_row = per_row + mix.l1 * diff.abs().sum(-1)
    selector = None
    if top_k:
        sel_terms, correct, dscores, ids = selector_chunk(logits, reference, sel_gate, successor, sel_weights, top_k,
                                                          mix.selector_join, tile_max)
        selector = (sel_terms, dscores, ids)
    else:
        correct = (row_argmax(logits, tile_max) == reference).float()
    q_reference = log_q.gather(1, reference[:, None]).squeeze(1).exp()
    terms = per_row * weights
    if not with_grad:
        return terms, correct, q_reference, None, selector, None
    hard = mix.ce + mix.target_argmax
    dlogits = hard * log_q.exp() if hard else torch.zeros_like(log_q)
    if p_t is not None:
        dlogits = dlogits + (mix.kl * mix.temperature) * (log_q_t.exp() - p_t)
    if mix.l1:
        dlogits = dlogits + mix.l1 * q * (sign - (sign * q).sum(-1, keepdim=True))
    dlogits = dlogits * weights[:, None]
    columns, amounts = [], []  # the one-hots, and the selector's pull on the hidden state (it rides the head's product)
    if mix.ce:
        columns.append(labels[:, None]), amounts.append(-mix.ce * weights[:, None])
    if mix.target_argmax:
        columns.append(reference[:, None]), amounts.append(-mix.target_argmax * weights[:, None])
    if selector is not None and mix.selector_shares_row_scale:
        columns.append(ids), amounts.append(dscores)
    # the product's dtype, but fp32 where more than the head's product reads the gradient
    dtype = head.dtype if isinstance(head, torch.Tensor) and bias_code is None else torch.float32
    index = torch.cat(columns, 1) if columns else labels.new_zeros(labels.shape[0], 0)
    at_index = None
    if hard and p_t is None and not mix.l1:  # the gradient at the columns from their log-probabilities alone
        at_index = hard * log_q.gather(1, index).exp() * weights[:, None]
    dlogits = add_at(dlogits, index, torch.cat(amounts, 1) if amounts else dlogits.new_zeros(labels.shape[0], 0),
                     dtype, at_index)
    bias = None if bias_code is None else bias_grads(dlogits, bias_code, bias_proj)
    return terms, correct, q_reference, _input_grad(head, dlogits), selector, bias


class _ChunkLoss(torch.autograd.Function):
    """A chunk's per-row losses (and a selector's, when it has one) whose backward only scales each
    row's gradient its forward formed (`_chunk_loss`): no logits are kept or recomputed, and the
    frozen head gets no gradient."""

    @staticmethod
    def forward(ctx, h, head, labels, weights, target_h, target_logits_fn, mix, chunk_loss, selector_backward_fn,
                sel_gate, successor, sel_weights, top_k, bias_code, bias_proj):
        terms, correct, q_reference, grad_h, selector, bias = chunk_loss(
            h, head, labels, weights, target_h, target_logits_fn, mix, True, sel_gate, successor, sel_weights, top_k,
            bias_code, bias_proj)
        ctx.h_dtype, ctx.selector_backward, ctx.bias = h.dtype, selector_backward_fn, bias
        ctx.selector_folded = mix.selector_shares_row_scale  # grad_h holds the selector's part (`add_at`)
        ctx.bias_dtypes = None if bias is None else (bias_code.dtype, bias_proj.dtype)
        if selector is None:
            ctx.save_for_backward(grad_h)
            sel_terms = terms.new_zeros(0)
        else:
            sel_terms, dscores, ids = selector
            ctx.save_for_backward(grad_h, head, successor, sel_gate, dscores, ids)
        ctx.mark_non_differentiable(correct, q_reference)
        return terms, sel_terms, correct, q_reference

    @staticmethod
    def backward(ctx, grad_terms, grad_sel, _grad_correct, _grad_q):
        grad_h, *selector = ctx.saved_tensors
        grad_h = grad_h.float() * grad_terms[:, None]
        grad_gate = grad_successor = None
        if selector:
            head, successor, gate, dscores, ids = selector
            sel_h, grad_gate, grad_successor = ctx.selector_backward(head, successor, gate, ids, dscores, grad_sel,
                                                                     not ctx.selector_folded)
            if sel_h is not None:
                grad_h = grad_h + sel_h.float()
        grad_code = grad_proj = None
        if ctx.bias is not None:  # the projection's: one scalar for all rows (draft/logit_bias.py)
            grad_code = (ctx.bias[0] * grad_terms[:, None]).to(ctx.bias_dtypes[0])
            grad_proj = (ctx.bias[1] * grad_terms.mean()).to(ctx.bias_dtypes[1])
        return (grad_h.to(ctx.h_dtype), None, None, None, None, None, None, None, None, grad_gate, grad_successor,
                None, None, grad_code, grad_proj)


def _run_chunk(chunk_loss, h, head, labels, weights, target_h, target_logits_fn, mix: LossMix,
               selector: tuple | None = None, backward=selector_backward, bias: tuple | None = None):
    """One chunk's (per-row losses, selector losses, correct, probability of the checked token): with
    their gradient when `h` needs one. `selector`: the chunk's (gate, successor, weights, top_k);
    `bias`: its logit bias (code, proj)."""
    sel = (*(selector or (None, None, None, 0)), *(bias or (None, None)))
    if h.requires_grad:
        return _ChunkLoss.apply(h, head, labels, weights, target_h, target_logits_fn, mix, chunk_loss, backward, *sel)
    terms, correct, q, _, out, _ = chunk_loss(h, head, labels, weights, target_h, target_logits_fn, mix, False, *sel)
    return terms, terms.new_zeros(0) if out is None else out[0], correct, q


def dpace_weights(q: torch.Tensor, counted: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE slot weights [blocks, B] from the drafter's probability `q` of each slot's checked token
    and the slots that count (0/1), as SpecForge 0.2.0 defines its `dpace` loss.

    A round accepts slots 1..j while each is right; with s_i = (1 - alpha) q_i + alpha (q smoothed
    towards 1, so one unlikely slot does not silence the rest) the expected accepted length is
    E = sum_j prod_{i<=j} s_i over counted j. Its derivative in log s_k is sum_{j>=k} prod_{i<=j} s_i:
    the weight of slot k. A slot counts in proportion to the acceptance still riding on it: early
    slots, and slots after confident ones, weigh most. Slots that do not count are 1 in the
    products and 0 in the sums. Detached: the weights steer the CE, they are not trained."""
    with torch.no_grad():
        smooth = torch.where(counted > 0, (1 - alpha) * q + alpha, torch.ones_like(q))
        prefix = torch.cumprod(smooth, dim=-1)
        return (prefix * counted).flip(-1).cumsum(-1).flip(-1) * counted


@functools.cache
def _compiled_selector_backward():
    """`selector_backward` under torch.compile, beside the compiled chunk (static shapes)."""
    return torch.compile(selector_backward, dynamic=False)


@functools.cache
def _compiled_chunk_loss():
    """`_chunk_loss` under torch.compile: the loss and its gradient are a dozen vocabulary-wide
    elementwise passes and reductions per row in eager mode; compiled, they fuse. Static shapes:
    `block_loss` pads the last chunk, so one graph serves all (one more without the gradient, for
    forwards under no_grad; the held-out probe keeps grad mode on, as training's graphs were traced,
    and pays for a gradient it drops)."""
    return torch.compile(_chunk_loss, dynamic=False)


DEFAULT_CHUNK_ROWS = 4096
CHUNK_LOGITS = DEFAULT_CHUNK_ROWS * 151_936
"""Logits one LM-head chunk may hold when objective.ce_chunk_size is unset (2.3 GiB in fp32)."""


def loss_chunk_rows(ce_chunk_size: int | None, vocab_size: int) -> int:
    """objective.ce_chunk_size, or the rows whose logits fit CHUNK_LOGITS (a multiple of 64: the
    matmuls' tile): a 262K vocabulary must not make a chunk's logits 1.7x larger than Qwen3's."""
    if ce_chunk_size is not None:
        return ce_chunk_size
    return max(64, min(DEFAULT_CHUNK_ROWS, CHUNK_LOGITS // vocab_size) // 64 * 64)


def chunk_rows(rows: int, max_rows: int) -> int:
    """Rows per LM-head chunk: the fewest chunks of at most `max_rows`, split evenly (rounded up to
    a multiple of 64, the matmuls' tile) so that the compiled loss pads its last chunk by little.
    Each chunk costs a forward and a backward of host work, which bounds a small
    target's step (docs/benchmarks/throughput.md): fewer, larger chunks where memory allows."""
    if rows <= max_rows:
        return max(rows, 1)  # one chunk of exactly the rows
    even = -(-rows // -(-rows // max_rows))
    align = 64 if max_rows >= 64 else 1
    return min(max_rows, -(-even // align) * align)


def block_loss(
    hidden_BQH: torch.Tensor,
    lm_head,
    labels_BQ: torch.Tensor,
    weights_BQ: torch.Tensor,
    block_size: int,
    chunk_size: int = 4096,
    mix: LossMix = LossMix(),
    target_hidden_BQH: torch.Tensor | None = None,
    target_logits_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    compiled: bool = False,
    kernel: str = "chunked",
    even_chunks: bool = False,
    selector: SelectorInputs | None = None,
    bias: LogitBias | None = None,
    confidence: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> BlockLoss:
    """`lm_head`: the target's frozen head, its weight [V, H] or an `Fp8Head` (chunked kernel only).
    `target_hidden_BQH`: the target's final-normed hidden state at the position that predicts
    each slot's label (needed by the target kinds of `mix`); `target_logits_fn` turns it into logits.
    `compiled`: each chunk runs compiled (GPU training with train.compile). `kernel`: "chunked" (this
    module) or a fused library kernel for the CE-only mix (`fused_ce.py`, CUDA). `even_chunks`: the
    rows split into the fewest even chunks of at most `chunk_size` (`chunk_rows`); for row counts that
    repeat (length buckets: one compiled graph per bucket). Otherwise every compiled chunk is padded
    to `chunk_size`: one graph for any row count. `selector`: DFlash2's path selector, its loss
    formed in the same chunks (draft/selector_loss.py); the statistics then count its picks. `bias`: a
    logit bias per row (DSpark's Markov head, draft/logit_bias.py), added to the logits every term reads.
    `confidence`: ([rows] DSpark's confidence logits, [rows] their weights): `sum w * BCE(sigmoid(z),
    label)` joins the loss, the label 1 where the row's drafted token is the one acceptance checks (the
    statistics' `correct`, known once every chunk ran; through autograd: the head is one small product)."""
    if mix.needs_target and (target_hidden_BQH is None or target_logits_fn is None):
        raise ValueError("the loss mix distils from the target: pass its hidden states and logits function")
    h = hidden_BQH.reshape(-1, hidden_BQH.shape[-1])
    labels, weights = labels_BQ.reshape(-1), weights_BQ.reshape(-1)
    t_h = None if target_hidden_BQH is None else target_hidden_BQH.reshape(-1, target_hidden_BQH.shape[-1])
    rows = h.shape[0]
    if isinstance(lm_head, torch.Tensor) and lm_head.requires_grad:
        raise ValueError("the LM head is the target's, frozen: the loss gives no gradient for it")
    counted = (weights > 0).float()
    if kernel != "chunked":
        if mix.needs_target or compiled or mix.dpace_alpha is not None or selector is not None or bias is not None:
            raise ValueError(f"train.ce_kernel={kernel} computes the CE loss only, uncompiled and decay-weighted: set "
                             "objective.loss to ce, objective.slot_weights to decay and train.compile_loss to "
                             "false, or use train.ce_kernel=chunked")
        if not isinstance(lm_head, torch.Tensor):
            raise ValueError(f"train.ce_kernel={kernel} runs the head in bf16: use train.ce_kernel=chunked with "
                             "train.fp8_lm_head")
        total, correct = fused_ce(kernel, h, lm_head, labels, weights, chunk_size)
        return block_statistics(mix.ce * total, correct * counted, counted, block_size)
    if selector is not None and not isinstance(lm_head, torch.Tensor):
        raise ValueError("DFlash2's selector loss reads rows of the head's weight: train without train.fp8_lm_head")
    if bias is not None and mix.dpace_alpha is not None:
        raise ValueError("D-PACE weighs rows after their chunk ran, which a logit bias's projection gradient "
                         "cannot follow (draft/logit_bias.py): set objective.slot_weights=decay")
    per_row = [h, labels, weights, t_h, None, None, None]
    if selector is not None:
        per_row[4:6] = selector.gate.reshape(rows, -1), selector.weights.reshape(-1)
    if bias is not None:
        per_row[6] = bias.code.reshape(rows, -1)
    kept = None
    if not compiled and h.device.type == "cpu":
        # Zero-weight rows (slot 0, labels past the response, invalid anchors) add nothing to the loss:
        # leave them out of the LM head, which dominates a CPU step (short answers: ~20% of the rows).
        # CPU only: on a GPU the data-dependent row count would cost a host sync every step.
        kept = counted.nonzero().squeeze(1)
        per_row = [None if x is None else x[kept] for x in per_row]
    chunk_loss, backward = _chunk_loss, selector_backward
    if even_chunks:
        chunk_size = chunk_rows(per_row[0].shape[0], chunk_size)
    if compiled:
        chunk_loss, backward = _compiled_chunk_loss(), _compiled_selector_backward()
        pad = -rows % chunk_size  # zero-weight rows: every chunk has the same shape
        per_row = [None if x is None else F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) for x in per_row]
    total = h.new_zeros((), dtype=torch.float32)
    if h.requires_grad:
        total = total + h.sum() * 0  # stays differentiable even when no row counts
    correct, terms, sel_terms, q_reference = [], [], [], []  # all but the first kept for D-PACE only
    for start in range(0, per_row[0].shape[0], chunk_size):
        h_c, labels_c, weights_c, t_h_c, gate_c, sel_w_c, code_c = (
            None if x is None else x[start : start + chunk_size] for x in per_row)
        sel = None if selector is None else (gate_c, selector.successor, sel_w_c, selector.top_k)
        bias_c = None if bias is None else (code_c, bias.proj)
        t, s, c, q = _run_chunk(chunk_loss, h_c, lm_head, labels_c, weights_c, t_h_c, target_logits_fn, mix, sel,
                                backward, bias_c)
        correct.append(c.detach())
        if mix.dpace_alpha is None:
            total = total + t.sum()
        else:
            terms.append(t)
            q_reference.append(q.detach())
        if selector is not None and mix.dpace_alpha is not None and mix.selector_slot_weighted:
            sel_terms.append(s)
        elif selector is not None:
            total = total + s.sum()
    correct = torch.cat(correct) if correct else counted.new_zeros(0)
    if terms:
        # every row's probability is known only now: the blocks' weights span chunks
        q = _full_rows(torch.cat(q_reference), kept, rows)
        slot_weights = dpace_weights(q.view(-1, block_size), counted.view(-1, block_size), mix.dpace_alpha).view(-1)
        slot_weights = slot_weights if kept is None else slot_weights[kept]
        n = slot_weights.shape[0]
        total = total + (torch.cat(terms)[:n] * slot_weights).sum()
        if sel_terms:
            total = total + (torch.cat(sel_terms)[:n] * slot_weights).sum()
    correct = _full_rows(correct, kept, rows) * counted
    if confidence is not None:
        logits, conf_weights = (x.reshape(-1) for x in confidence)
        total = total + F.binary_cross_entropy_with_logits(logits.float(), correct, weight=conf_weights,
                                                           reduction="sum")
    return block_statistics(total, correct, counted, block_size)


def _full_rows(values: torch.Tensor, kept: torch.Tensor | None, rows: int) -> torch.Tensor:
    """Per-row `values` of the rows the loss ran on (the `kept` ones, or every row and some padding)
    laid out over all `rows` (0 where a row was left out)."""
    if kept is not None:
        return values.new_zeros(rows).index_copy_(0, kept, values)
    return values[:rows]
