"""Speculative decoding of many prompts at once: acceptance over whole prompt sets in few passes.

Every round runs the drafter, then the target, over all unfinished rows together. Rows accept
different numbers of tokens. By default the target runs through a ragged KV cache (`RaggedCache`:
one cache for rows of different lengths, a round costs the block alone) and the drafter keeps its
context keys/values in the same layout (`RaggedDraftCache`: each context position projected once).
Where the target cannot take one (`RaggedCache.supports`: other attention kernels, layers no mask
expresses) each round re-runs the target over each row's whole sequence instead (committed tokens +
the new block, right-padded, causal: no mask, or the model's own where its layers slide) and the
drafter over each row's whole context, which costs rounds x sequence length.

Decisions are `speculative_generate`'s, round by round: same block, same context features (the
target's, of every committed position before the block), same acceptance rule (the tests hold
both paths to the same tokens and acceptance lengths). Timing is not: speed comes from
`speculative_generate`, which decodes the way a server does, with caches, one prompt at a time.
"""

from __future__ import annotations

from functools import partial

import torch

from dflash_train.draft import masks
from dflash_train.draft.model import DFlashDraftModel
from dflash_train.decode.engines import Engine
from dflash_train.decode.ragged_cache import RaggedCache, RaggedDraftCache
from dflash_train.decode.rounds import decode_rows
from dflash_train.decode.spec_decode import (SpecResult, accept_sampled, check_budget, draft_limits, propose,
                                             sample_tokens)
from dflash_train.decode.sampling import emit_tokens
from dflash_train.targets.model import Target


def _right_padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    ids = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
    return ids.to(device)


def _draft(drafter: DFlashDraftModel, target: Target, context: torch.Tensor, context_positions: torch.Tensor,
           starts: torch.Tensor, last: torch.Tensor, block_size: int, cache: RaggedDraftCache | None = None):
    """(hidden states [R, B, H], blocks [R, B]) of the drafter: row r's block [last_r, MASK...] at
    positions starts_r.., seeing the
    context of positions 0..starts_r-1 and the whole block (a block attends both ways). `context`
    [R, C, K*H] at `context_positions`: every position (right-padded), or with a `cache` only those
    it has not seen yet (the cache's width is then the longest row's start)."""
    rows, device = context.shape[0], context.device
    block = torch.full((rows, block_size), drafter.config.mask_token_id, dtype=torch.long, device=device)
    block[:, 0] = last
    width = context.shape[1] if cache is None else int(starts.max())
    mask = masks.decode_mask(starts, width, block_size, drafter.config.sliding_window)
    positions = starts[:, None] + torch.arange(block_size, device=device)
    return drafter(context, target.embed_weight[block], context_positions, positions, mask=mask, cache=cache), block


def _verify(target: Target, rows: list[list[int]], starts: torch.Tensor, block_size: int, layer_ids: list[int]):
    """Target logits [R, B, V] at each row's block (the last B tokens of rows[r], from starts_r)
    and features [R, T, K*H] of every position."""
    hidden, features = target.hidden_and_features(_right_padded(rows, target.device), layer_ids)
    at = (starts[:, None] + torch.arange(block_size, device=starts.device))[..., None].expand(-1, -1, hidden.shape[-1])
    return target.logits(hidden.gather(1, at)), features


def _accept(proposals, draft_logits, target_logits, temperature, generator, limits=None) -> list[tuple[int, int]]:
    """Per row: (accepted proposals n, the target's token after them), as `speculative_generate` decides;
    `limits` [R]: proposals drafted per row (`draft_limits`), None: all."""
    if temperature == 0:
        choice = target_logits.argmax(-1)  # [R, B]: choice[:, k] checks proposal k (slot k+1)
        n = (proposals == choice[:, :-1]).long().cumprod(1).sum(1)
        n = n if limits is None else torch.minimum(n, limits)
        return list(zip(n.tolist(), choice.gather(1, n[:, None])[:, 0].tolist()))
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    return [accept_sampled(proposals[r], q[r], p[r], generator) for r in range(proposals.shape[0])]


class BatchedSpeculative:
    """`speculative_generate`'s decisions for a group of rows at once (a RoundDecoder:
    decode/rounds.py); `cached`: the target through the ragged KV cache, else cache-free."""

    def __init__(self, target: Target, drafter: DFlashDraftModel, max_new_tokens: int, stop_ids: set[int],
                 temperature: float, block_size: int, generator, cached: bool, draft_p_min: float = 0.0):
        self.target, self.drafter, self.device = target, drafter, target.device
        self.max_new_tokens, self.stop_ids, self.temperature = max_new_tokens, stop_ids, temperature
        self.block_size, self.generator, self.cached = block_size, generator, cached
        self.layer_ids, self.draft_p_min = drafter.config.target_layer_ids, draft_p_min

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        """The first token, and the prompt's features as the first context."""
        device, b = self.device, self.block_size
        self.results = [SpecResult(tokens=[], decode_seconds=0.0, block_size=b, position_accepts=[0] * (b - 1))
                        for _ in prompts]
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        self.ragged = RaggedCache(self.target, self.layer_ids) if self.cached else None
        ids = _right_padded(prompts, device)
        hidden, self.context = (self.ragged.prefill(ids, lengths) if self.ragged
                                else self.target.hidden_and_features(ids, self.layer_ids))
        first = sample_tokens(self.target.logits(hidden[torch.arange(len(prompts), device=device), lengths - 1]),
                              self.temperature, self.generator).tolist()
        self.seqs = [list(p) + [t] for p, t in zip(prompts, first)]  # committed; the last is the next block's slot 0
        self.active = [i for i, t in enumerate(first)
                       if not emit_tokens(self.results[i].tokens, [t], self.max_new_tokens, self.stop_ids)]
        self.keep = torch.tensor(self.active, dtype=torch.long, device=device)
        if self.ragged and self.active:
            self.draft_cache = RaggedDraftCache(self.drafter.config.num_hidden_layers)
            self.draft_cache.reindex(self.keep, self.ragged.advance(torch.zeros_like(lengths), self.keep))
            self.new_context = self.context[self.keep]
            self.new_positions = torch.arange(ids.shape[1], device=device).expand(len(self.active), -1)
        return [i for i in range(len(prompts)) if i not in self.active]

    def decoding(self) -> bool:
        return bool(self.active)

    def step(self) -> list[int]:
        """One round over the active rows. Each row's block starts at its last committed token; the
        context holds the features of every position before it (the slot 0 and accepted proposals
        it verified included)."""
        device, b, active, ragged = self.device, self.block_size, self.active, self.ragged
        starts = torch.tensor([len(self.seqs[i]) - 1 for i in active], device=device)
        if not ragged:
            self.context = self.context[self.keep, : int(starts.max())]
        last = torch.tensor([self.seqs[i][-1] for i in active], device=device)
        if ragged:
            hidden, block = _draft(self.drafter, self.target, self.new_context, self.new_positions, starts, last, b,
                                   self.draft_cache)
        else:
            positions = torch.arange(self.context.shape[1], device=device).expand(len(active), -1)
            hidden, block = _draft(self.drafter, self.target, self.context, positions, starts, last, b)
        proposals, draft_logits = propose(self.drafter, self.target, hidden, block, self.temperature, self.generator)
        limits = draft_limits(self.drafter, self.target, hidden, block, proposals, self.draft_p_min)
        drafted = proposals.tolist()
        if ragged:
            hidden, features = ragged.extend(torch.cat([last[:, None], proposals], dim=1))
            target_logits = self.target.logits(hidden)
        else:
            target_logits, self.context = _verify(
                self.target, [self.seqs[i] + drafted[r] for r, i in enumerate(active)], starts, b, self.layer_ids
            )
        still, kept = [], []
        decisions = _accept(proposals, draft_logits, target_logits, self.temperature, self.generator, limits)
        limited = [b - 1] * len(active) if limits is None else limits.tolist()
        for r, (i, (n, token)) in enumerate(zip(active, decisions)):
            result = self.results[i]
            result.acceptance_lengths.append(n + 1)
            result.draft_lengths.append(limited[r])
            for k in range(n):
                result.position_accepts[k] += 1
            self.seqs[i] += drafted[r][:n] + [token]
            kept.append(n + 1)
            if not emit_tokens(result.tokens, drafted[r][:n] + [token], self.max_new_tokens, self.stop_ids):
                still.append(r)
        self.keep = torch.tensor(still, dtype=torch.long, device=device)
        if ragged and still:
            self.draft_cache.reindex(self.keep, ragged.advance(torch.tensor(kept, device=device), self.keep))
            self.new_context = features[self.keep]  # every slot of the block: the gather keeps the accepted ones
            self.new_positions = (starts[:, None] + torch.arange(b, device=device))[self.keep]
        self.active = [active[r] for r in still]
        return [i for i in active if i not in self.active]


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
    cached: bool | None = None,
    draft_p_min: float = 0.0,
) -> list[SpecResult]:
    """`speculative_generate` for each token-id prompt, `batch_size` rows at a time (BatchedSpeculative;
    no timings: decode_seconds stays 0). `cached`: through the target's ragged KV cache (default: when the
    target supports it, `RaggedCache.supports`), else cache-free. `draft_p_min`: a DSpark or DFlash2
    drafter's draft stops at its first slot of confidence below it, as llama.cpp's --spec-draft-p-min
    (0: off)."""
    check_budget(max_new_tokens)
    if not prompts or min(map(len, prompts)) < 1:
        raise ValueError("batched_speculative needs at least one prompt, each of at least one token")
    why_not = RaggedCache.supports(target)
    if cached and why_not:
        raise ValueError(f"batched_speculative(cached=True): {why_not}")
    cached = why_not is None if cached is None else cached
    block_size = block_size or drafter.config.block_size
    decoder = BatchedSpeculative(target, drafter, max_new_tokens, set(stop_ids), temperature, block_size, generator,
                                 cached, draft_p_min)
    with torch.no_grad():
        return [result for i in range(0, len(prompts), batch_size)
                for result in decode_rows(decoder, prompts[i : i + batch_size])[0]]


def _ragged_problem(target: Target, temperature: float) -> str | None:
    return RaggedCache.supports(target)


ACCEPTANCE_ENGINES: dict[str, Engine] = {
    "ragged": Engine(partial(batched_speculative, cached=True), _ragged_problem),
    "none": Engine(partial(batched_speculative, cached=False)),
}
"""How acceptance decoding runs the target (`decode.acceptance_cache`): `ragged`, through one KV cache
for rows of different lengths; `none`, the rows' whole sequences each round. Each `run` is
batched_speculative's signature without `cached`."""
ACCEPTANCE_AUTO = ("ragged", "none")
