"""DFlash speculative decoding, as a ladder of small functions (after gpt-fast).

draft_block -> propose -> accept_greedy / accept_sampled -> OneRowSpeculative's step -> speculative_generate.

One round, with `start` = position of the last emitted token (the target has not run on it yet):
  block    = [last token, MASK x (B-1)] at positions start .. start+B-1
  drafter  = ONE forward over the context it has not seen yet (its DraftKVCache holds the rest);
             slots 1..B-1 are the proposals
  target   = ONE forward over the block with its KV cache, capturing the drafter's layers
  accept   = the longest prefix of proposals the target agrees with, plus one token from the
             target (the bonus, or the correction at the first miss)
  the target cache is cropped to the accepted tokens, whose captured features become the next
  round's new context. Acceptance length of a round = accepted proposals + 1 (tau counts the bonus).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dflash_train.draft import masks
from dflash_train.draft.model import DFlashDraftModel, DraftKVCache
from dflash_train.decode.rounds import decode_rows
from dflash_train.decode.sampling import emit_tokens
from dflash_train.families import family
from dflash_train.targets.model import Target


@dataclass
class DecodeResult:
    tokens: list[int]
    """New tokens only, stop token included when one ended the decode."""
    decode_seconds: float
    """Wall time after prefill (the first token comes from the prefill and is not timed)."""


@dataclass
class SpecResult(DecodeResult):
    block_size: int = 16
    acceptance_lengths: list[int] = field(default_factory=list)
    """Per round: accepted proposals + 1 (the bonus/correction token), as verified, even when the
    max_new_tokens budget or a stop token cut the round's emitted tokens short."""
    position_accepts: list[int] = field(default_factory=list)
    """[B-1]: number of rounds in which proposal k (slot k+1) was accepted."""
    draft_lengths: list[int] = field(default_factory=list)
    """Per round: proposals drafted, B-1 but where decode.draft_p_min cut the draft (`draft_limits`)."""

    @property
    def num_rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(1, self.num_rounds)


def check_budget(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def sample_tokens(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """[..., V] -> [...]: argmax at temperature 0, else a sample of softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


# ----------------------------------------------------------------------------- target only


class TargetGreedy:
    """The target alone, one prompt, greedy, with transformers' dynamic cache: the reference, and
    target-only tokens/s (a RoundDecoder: decode/rounds.py)."""

    def __init__(self, target: Target, max_new_tokens: int, stop_ids=()):
        check_budget(max_new_tokens)
        self.target, self.device = target, target.device
        self.max_new_tokens, self.stop_ids = max_new_tokens, set(stop_ids)

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        (prompt,) = prompts  # one sequence at a time
        self.cache = DynamicCache(config=self.target.model.config)
        self.result = DecodeResult(tokens=[], decode_seconds=0.0)
        self.results = [self.result]
        ids = torch.tensor([prompt], device=self.device)
        logits = self.target.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits
        return self._emit(logits[0, -1].argmax())

    def step(self) -> list[int]:
        logits = self.target.model(input_ids=self.token.view(1, 1), past_key_values=self.cache, use_cache=True).logits
        return self._emit(logits[0, -1].argmax())

    def decoding(self) -> bool:
        return not self.done

    def _emit(self, token: torch.Tensor) -> list[int]:
        self.token = token
        self.done = emit_tokens(self.result.tokens, [int(token)], self.max_new_tokens, self.stop_ids)
        return [0] if self.done else []


@torch.no_grad()
def target_greedy(target: Target, input_ids: torch.Tensor, max_new_tokens: int, stop_ids=()) -> DecodeResult:
    """Plain greedy decode of `input_ids` [1, P] (TargetGreedy)."""
    (result,), seconds = decode_rows(TargetGreedy(target, max_new_tokens, stop_ids), input_ids.tolist())
    result.decode_seconds = seconds
    return result


# ----------------------------------------------------------------------------- speculative


def _target_forward(target: Target, ids: torch.Tensor, cache: DynamicCache, layer_ids: list[int], keep: int = 0):
    """Logits [T, V] (the last `keep` only, 0 = all) and concatenated features [1, T, K*H] of `ids`
    appended to the cached sequence."""
    with target.capture(layer_ids) as store:
        logits = target.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=keep).logits
    return logits[0], torch.cat([store[i] for i in layer_ids], dim=-1)


def draft_block(
    drafter: DFlashDraftModel,
    target: Target,
    block_ids: torch.Tensor,
    start: int,
    context_new: torch.Tensor,
    cache: DraftKVCache,
) -> torch.Tensor:
    """The drafter's final hidden states [1, B, H] of the block at positions start..start+B-1.

    `context_new` [1, C, K*H] holds the features of positions cache.length .. start-1: every
    context token precedes the block, so no mask is needed, but for a drafter's sliding window.
    """
    device = block_ids.device
    ctx_positions = torch.arange(cache.length, start, device=device)[None]
    block_positions = torch.arange(start, start + block_ids.shape[0], device=device)[None]
    assert ctx_positions.shape[1] == context_new.shape[1], "context features out of step with positions"
    window = drafter.config.sliding_window
    mask = None if window is None else masks.decode_mask(block_positions[:, 0], start, block_ids.shape[0], window)
    return drafter(context_new, target.embed_weight[block_ids][None], ctx_positions, block_positions, mask=mask,
                   cache=cache)


def propose(drafter: DFlashDraftModel, target: Target, hidden: torch.Tensor, block_ids: torch.Tensor,
            temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(proposals [b, B-1], their draft logits or None at temperature 0) of blocks [b, B] from the
    drafter's hidden states [b, B, H]: greedy as the drafter's family drafts (DFlash2's selector walks
    its candidates), else a sample of each slot's distribution (DFlash only)."""
    if temperature == 0:
        return drafter.propose_greedy(hidden, target.lm_head_weight, block_ids), None
    if not family(drafter.config.family).independent_slots:
        raise ValueError(f"temperature {temperature}: sampled drafting is implemented for drafters whose slots "
                         f"are drafted independently; evaluate family {drafter.config.family} at temperature 0")
    logits = hidden[:, 1:] @ target.lm_head_weight.T
    return sample_tokens(logits, temperature, generator), logits


def draft_limits(drafter: DFlashDraftModel, target: Target, hidden: torch.Tensor, block_ids: torch.Tensor,
                 proposals: torch.Tensor, p_min: float) -> torch.Tensor | None:
    """[b] proposals the draft keeps when it stops at the first slot of confidence below `p_min`
    (llama.cpp's --spec-draft-p-min: DSpark's confidence head, DFlash2's selector); None: 0, every
    proposal is drafted.
    The target still checks the whole block; acceptance stops at the limit, so the decisions are a
    shorter draft's (the target's token after the kept proposals does not read the ones past them)."""
    return None if p_min <= 0 else drafter.draft_limits(hidden, target.lm_head_weight, block_ids, proposals, p_min)


def accept_greedy(proposals: torch.Tensor, target_logits: torch.Tensor, limit: int | None = None) -> tuple[int, int]:
    """(accepted proposals n, the target's token after them) at temperature 0; `limit`: at most that
    many proposals were drafted (`draft_limits`).

    target_logits[k] predicts the token after block slot k, so it checks proposal k (slot k+1).
    """
    choice = target_logits.argmax(-1)  # [B]
    n = int((proposals == choice[:-1]).cumprod(0).sum())
    n = n if limit is None else min(n, limit)
    return n, int(choice[n])


def accept_sampled(
    proposals: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) over one block.

    Proposal x_k ~ q_k was drawn independently per slot (the drafter sees masks, not earlier
    proposals), so conditioned on reaching slot k it is still a q_k sample and the standard
    argument holds: accept with prob min(1, p_k(x)/q_k(x)); at the first rejection emit a sample
    of norm(max(0, p_k - q_k)); if all pass, the bonus is a sample of p_B. Every emitted token is
    then distributed exactly as the target's p. Shapes: proposals [B-1], draft_probs [B-1, V],
    target_probs [B, V].
    """
    k = torch.arange(proposals.shape[0], device=proposals.device)
    p_x, q_x = target_probs[k, proposals], draft_probs[k, proposals]
    u = torch.rand(proposals.shape, generator=generator, device=proposals.device)
    n = int((u * q_x < p_x).cumprod(0).sum())  # u < p/q without dividing by a tiny q
    if n == proposals.shape[0]:
        probs = target_probs[n]
    else:
        probs = (target_probs[n] - draft_probs[n]).clamp(min=0)
        if probs.sum() <= 0:  # p == q up to rounding: the residual is empty, p itself is exact
            probs = target_probs[n]
    return n, int(torch.multinomial(probs, 1, generator=generator))


class OneRowSpeculative:
    """DFlash drafting and target verification of one prompt with transformers' dynamic cache (a
    RoundDecoder: decode/rounds.py); lossless: at temperature 0 its tokens are `TargetGreedy`'s, above
    it every token is a target sample (speculative sampling). `generator` lives on the target's device."""

    def __init__(self, target: Target, drafter: DFlashDraftModel, max_new_tokens: int, stop_ids=(),
                 temperature: float = 0.0, block_size: int | None = None, generator: torch.Generator | None = None,
                 draft_p_min: float = 0.0):
        check_budget(max_new_tokens)
        self.target, self.drafter, self.device = target, drafter, target.device
        self.draft_p_min = draft_p_min
        self.max_new_tokens, self.stop_ids = max_new_tokens, set(stop_ids)
        self.temperature, self.generator = temperature, generator
        self.block_size = block_size or drafter.config.block_size
        self.layer_ids = drafter.config.target_layer_ids

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        (prompt,) = prompts  # one sequence at a time
        self.cache = DynamicCache(config=self.target.model.config)
        self.cache.activate_past_recording()  # a sliding layer keeps the block until `crop`, so it can drop rejections
        ids = torch.tensor([prompt], device=self.device)
        # keep=1: no [P, V] logits; the prompt's features are the drafter's first context
        logits, self.context_new = _target_forward(self.target, ids, self.cache, self.layer_ids, keep=1)
        self.result = SpecResult(tokens=[], decode_seconds=0.0, block_size=self.block_size,
                                 position_accepts=[0] * (self.block_size - 1))
        self.results = [self.result]
        self.token = int(sample_tokens(logits[-1], self.temperature, self.generator))
        self.done = emit_tokens(self.result.tokens, [self.token], self.max_new_tokens, self.stop_ids)
        self.draft_cache = DraftKVCache(self.drafter.config.num_hidden_layers)
        self.start = len(prompt)  # position of `token`, the block's slot 0
        return [0] if self.done else []

    def step(self) -> list[int]:
        b, result = self.block_size, self.result
        block = torch.full((b,), self.drafter.config.mask_token_id, dtype=torch.long, device=self.device)
        block[0] = self.token
        hidden = draft_block(self.drafter, self.target, block, self.start, self.context_new, self.draft_cache)
        proposals, draft_logits = propose(self.drafter, self.target, hidden, block[None], self.temperature,
                                          self.generator)
        block[1:] = proposals[0]
        limit = draft_limits(self.drafter, self.target, hidden, block[None], proposals, self.draft_p_min)
        target_logits, features = _target_forward(self.target, block[None], self.cache, self.layer_ids)
        if self.temperature == 0:
            n, self.token = accept_greedy(block[1:], target_logits, None if limit is None else int(limit[0]))
            result.draft_lengths.append(b - 1 if limit is None else int(limit[0]))
        else:
            q = torch.softmax(draft_logits[0].float() / self.temperature, dim=-1)
            p = torch.softmax(target_logits.float() / self.temperature, dim=-1)
            n, self.token = accept_sampled(block[1:], q, p, self.generator)
        result.acceptance_lengths.append(n + 1)
        for k in range(n):
            result.position_accepts[k] += 1
        # Keep the target's cache and features for slot 0 and the n accepted proposals; `token`
        # (bonus/correction) is the next block's slot 0 at position start + n + 1.
        self.start += n + 1
        self.cache.crop(-(b - n - 1))  # negative = tokens to drop (transformers >= 5.17)
        self.context_new = features[:, : n + 1]
        self.done = emit_tokens(result.tokens, block[1 : n + 1].tolist() + [self.token], self.max_new_tokens,
                                self.stop_ids)
        return [0] if self.done else []

    def decoding(self) -> bool:
        return not self.done


@torch.no_grad()
def speculative_generate(
    target: Target,
    drafter: DFlashDraftModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_ids=(),
    temperature: float = 0.0,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
    draft_p_min: float = 0.0,
) -> SpecResult:
    """Decode `input_ids` [1, P] speculatively (OneRowSpeculative)."""
    assert input_ids.shape[0] == 1, "speculative decoding here is one sequence at a time"
    decoder = OneRowSpeculative(target, drafter, max_new_tokens, stop_ids, temperature, block_size, generator,
                                draft_p_min)
    (result,), seconds = decode_rows(decoder, input_ids.tolist())
    result.decode_seconds = seconds
    return result
