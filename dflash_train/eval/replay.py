"""Greedy speculative decoding replayed, teacher-forced, over an answer the target wrote itself.

When a held-out answer IS the target's greedy decode of its prompt, real DFlash decoding of that
prompt emits the same tokens, and a round's acceptance depends only on where its anchor sits: the
drafter sees the target's features of everything before the anchor, and the anchor's token. One
target forward over prompt + answer and one drafter forward with an anchor at every answer position
give every possible round's acceptance; chaining them from the first answer token gives the real
rounds, so real tau, at the cost of a teacher-forced pass.

Why not random anchors (tau_hat)? They weigh every position alike, but real decoding crosses an easy
stretch (a repeated phrase accepts whole blocks) in a few rounds and spends many rounds where the
drafter misses: tokens per round is a mean over rounds, not over positions. The 2026-12-01 SmolLM2
drafter read tau_hat 3.31 on held-out answers and decoded them at real tau 2.94.
"""

from __future__ import annotations

import torch

from dflash_train.draft import masks
from dflash_train.draft.objective import BlockTask, draft_hidden
from dflash_train.families import family

ANCHOR_CHUNK = 64
"""Anchors per drafter forward (64 blocks of hidden states at a time)."""


@torch.no_grad()
def accepted_prefixes(target, drafter, seq: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """For the anchors a = first .. last-1 of `seq` [1, T]: how many of the block's drafted slots
    match seq[a+1], seq[a+2], ... in a row (a slot past the end of `seq` matches nothing). Greedy:
    each slot's argmax over the target's LM head, as `speculative_generate` drafts."""
    block = drafter.config.block_size
    features = target.features(seq, drafter.config.target_layer_ids)
    out = []
    for start in range(first, last, ANCHOR_CHUNK):
        anchors = torch.arange(start, min(start + ANCHOR_CHUNK, last), device=seq.device)[None]
        valid = torch.ones_like(anchors, dtype=torch.bool)
        # Every token counts as a label here: a slot's weight is then nonzero exactly when it lies
        # inside `seq` (slot 0, the anchor, never counts).
        labels, weights = masks.block_labels(seq, torch.ones_like(seq), anchors, valid, block, 1.0)
        task = BlockTask(seq, anchors, valid, labels, weights)
        hidden = draft_hidden(drafter, task, features, target.embed_weight, use_flex=False)[0]
        slots = hidden.view(anchors.shape[1], block, -1).to(target.lm_head_weight.dtype)
        labels, inside = labels.view(-1, block), weights.view(-1, block) > 0
        if not family(drafter.config.family).independent_slots:  # a path over whole blocks (DFlash2's walk)
            drafted = drafter.propose_greedy(slots, target.lm_head_weight, seq[0, anchors[0]][:, None])
            out.append(((drafted == labels[:, 1:]) & inside[:, 1:]).long().cumprod(1).sum(1))
            continue
        accepted = torch.zeros(anchors.shape[1], dtype=torch.long, device=seq.device)
        alive = torch.arange(anchors.shape[1], device=seq.device)
        for k in range(1, block):  # the LM head only for blocks still accepting: ~tau_hat, not 15, per anchor
            drafted = (slots[alive, k] @ target.lm_head_weight.T).argmax(-1)
            alive = alive[(drafted == labels[alive, k]) & inside[alive, k]]
            accepted[alive] += 1
            if not len(alive):
                break
        out.append(accepted)
    return torch.cat(out).cpu()


def replay_rounds(prefixes: list[int], new_tokens: int, answer_tokens: int) -> list[int]:
    """Acceptance lengths (accepted drafts + the target's own token) of the rounds greedy decoding
    makes over an answer of `answer_tokens` tokens whose anchor at answer index i accepts
    `prefixes[i]` drafts, until `new_tokens` are emitted or the answer ends. The prefill emits the
    first token; each round's anchor is the last emitted token, as in `speculative_generate`, whose
    last round also counts drafts past the budget (they were verified) but none past the answer."""
    lengths, anchor = [], 0
    while anchor < min(new_tokens, answer_tokens) - 1:
        length = min(prefixes[anchor], answer_tokens - 1 - anchor) + 1
        lengths.append(length)
        anchor += length
    return lengths


def replayed_rounds(target, drafter, input_ids: torch.Tensor, loss_mask: torch.Tensor, new_tokens: int) -> list[int]:
    """The acceptance lengths of greedy DFlash decoding of one held-out row ([T] token ids and loss
    mask; its first answer, the first run of loss tokens, the target's greedy decode) over the
    answer's first `new_tokens` tokens."""
    answer = loss_mask.nonzero().flatten()
    if not len(answer):
        return []
    first = int(answer[0])
    gaps = (loss_mask[first:] == 0).nonzero()
    answer_tokens = int(gaps[0]) if len(gaps) else len(loss_mask) - first
    anchors = min(new_tokens, answer_tokens) - 1  # the last emitted token anchors no round
    if anchors < 1:
        return []
    seq = input_ids[None, : first + anchors + drafter.config.block_size]
    prefixes = accepted_prefixes(target, drafter, seq, first, first + anchors).tolist()
    return replay_rounds(prefixes, new_tokens, answer_tokens)
