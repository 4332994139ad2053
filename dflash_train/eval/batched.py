"""Speculative decoding of many prompts at once, cache-free: acceptance at the cost of a few passes.

Every round runs the drafter, then the target, over all unfinished rows together. Rows accept
different numbers of tokens, so instead of a ragged KV cache each round re-runs the target over
each row's whole sequence (committed tokens + the new block, right-padded, causal: no mask). For
a small target a round of 64 rows costs about what one row's round costs on a host-bound batch-1
decoder, so a whole benchmark set is a few hundred rounds.

Decisions are `speculative_generate`'s, round by round: same block, same context features (the
target's, of every committed position before the block), same acceptance rule (the tests hold the
two to the same tokens and acceptance lengths). Timing is not: speed comes from
`speculative_generate`, which decodes the way a server does, with caches.
"""

from __future__ import annotations

import torch

from dflash_train.draft.model import DFlashDraftModel
from dflash_train.eval.spec_decode import SpecResult, accept_sampled, check_budget, sample_tokens
from dflash_train.generate.backends import emit_tokens
from dflash_train.target import Target


def _right_padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    ids = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
    return ids.to(device)


def _draft(drafter: DFlashDraftModel, target: Target, context: torch.Tensor, starts: torch.Tensor,
           last: torch.Tensor, block_size: int) -> torch.Tensor:
    """Draft logits [R, B-1, V]: row r's block [last_r, MASK...] at positions starts_r.., its context
    the features of positions 0..starts_r-1 (context [R, C, K*H], right-padded)."""
    rows, width = context.shape[:2]
    device = context.device
    block = torch.full((rows, block_size), drafter.config.mask_token_id, dtype=torch.long, device=device)
    block[:, 0] = last
    offsets = torch.arange(block_size, device=device)
    ctx_positions = torch.arange(width, device=device).expand(rows, width)
    # Each block sees its own row's real context and the whole block (a block attends both ways).
    visible = torch.cat([ctx_positions < starts[:, None], torch.ones_like(block, dtype=torch.bool)], dim=1)
    mask = visible[:, None, None, :].expand(rows, 1, block_size, width + block_size)
    hidden = drafter(context, target.embed_weight[block], ctx_positions, starts[:, None] + offsets, mask=mask)
    return hidden[:, 1:] @ target.lm_head_weight.T


def _verify(target: Target, rows: list[list[int]], starts: torch.Tensor, block_size: int, layer_ids: list[int]):
    """Target logits [R, B, V] at each row's block (the last B tokens of rows[r], from starts_r)
    and features [R, T, K*H] of every position."""
    hidden, features = target.hidden_and_features(_right_padded(rows, target.device), layer_ids)
    at = (starts[:, None] + torch.arange(block_size, device=starts.device))[..., None].expand(-1, -1, hidden.shape[-1])
    return target.logits(hidden.gather(1, at)), features


def _accept(proposals, draft_logits, target_logits, temperature, generator) -> list[tuple[int, int]]:
    """Per row: (accepted proposals n, the target's token after them), as `speculative_generate` decides."""
    if temperature == 0:
        choice = target_logits.argmax(-1)  # [R, B]: choice[:, k] checks proposal k (slot k+1)
        n = (proposals == choice[:, :-1]).long().cumprod(1).sum(1)
        return list(zip(n.tolist(), choice.gather(1, n[:, None])[:, 0].tolist()))
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    return [accept_sampled(proposals[r], q[r], p[r], generator) for r in range(proposals.shape[0])]


@torch.no_grad()
def _decode_group(target, drafter, prompts, max_new_tokens, stop_ids, temperature, block_size, generator):
    layer_ids = drafter.config.target_layer_ids
    device = target.device
    results = [SpecResult(tokens=[], decode_seconds=0.0, block_size=block_size, position_accepts=[0] * (block_size - 1))
               for _ in prompts]
    # Prefill: the first token, and the prompt's features as the first context.
    last_prompt_token = torch.tensor([len(p) - 1 for p in prompts], device=device)
    hidden, context = target.hidden_and_features(_right_padded(prompts, device), layer_ids)
    first = sample_tokens(target.logits(hidden[torch.arange(len(prompts), device=device), last_prompt_token]),
                          temperature, generator).tolist()
    seqs = [list(p) + [t] for p, t in zip(prompts, first)]  # committed; the last is the next block's slot 0
    active = [i for i, t in enumerate(first) if not emit_tokens(results[i].tokens, [t], max_new_tokens, stop_ids)]
    keep = torch.tensor(active, dtype=torch.long, device=device)
    while active:
        # Each row's block starts at its last committed token; the last forward's features cover
        # every position before it (the slot 0 and accepted proposals it verified included).
        starts = torch.tensor([len(seqs[i]) - 1 for i in active], device=device)
        context = context[keep, : int(starts.max())]
        last = torch.tensor([seqs[i][-1] for i in active], device=device)
        draft_logits = _draft(drafter, target, context, starts, last, block_size)
        proposals = sample_tokens(draft_logits, temperature, generator)
        drafted = proposals.tolist()
        target_logits, context = _verify(
            target, [seqs[i] + drafted[r] for r, i in enumerate(active)], starts, block_size, layer_ids
        )
        still = []
        for r, (i, (n, token)) in enumerate(zip(active, _accept(proposals, draft_logits, target_logits,
                                                                  temperature, generator))):
            result = results[i]
            result.acceptance_lengths.append(n + 1)
            for k in range(n):
                result.position_accepts[k] += 1
            seqs[i] += drafted[r][:n] + [token]
            if not emit_tokens(result.tokens, drafted[r][:n] + [token], max_new_tokens, stop_ids):
                still.append(r)
        keep = torch.tensor(still, dtype=torch.long, device=device)
        active = [active[r] for r in still]
    return results


def batched_speculative(
    target: Target,
    drafter: DFlashDraftModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids=(),
    temperature: float = 0.0,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
    batch_size: int = 64,
) -> list[SpecResult]:
    """`speculative_generate` for each token-id prompt, `batch_size` rows at a time (no timings:
    decode_seconds stays 0)."""
    check_budget(max_new_tokens)
    if not prompts or min(map(len, prompts)) < 1:
        raise ValueError("batched_speculative needs at least one prompt, each of at least one token")
    block_size = block_size or drafter.config.block_size
    results = []
    for i in range(0, len(prompts), batch_size):
        results += _decode_group(target, drafter, prompts[i : i + batch_size], max_new_tokens, set(stop_ids),
                                 temperature, block_size, generator)
    return results
