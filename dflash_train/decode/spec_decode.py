"""DFlash speculative decoding, as a ladder of small functions (after gpt-fast).

prefill -> draft_block -> verify_block -> accept_greedy / accept_sampled -> speculative_generate.

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

from dflash_train.draft.model import DFlashDraftModel, DraftKVCache
from dflash_train.decode.sampling import emit_tokens
from dflash_train.targets.model import Target, synced_time


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


@torch.no_grad()
def target_greedy(target: Target, input_ids: torch.Tensor, max_new_tokens: int, stop_ids=()) -> DecodeResult:
    """Plain greedy decode with the target's KV cache: the reference, and target-only tokens/s."""
    check_budget(max_new_tokens)
    stop_ids = set(stop_ids)
    cache = DynamicCache(config=target.model.config)
    logits = target.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    out: list[int] = []
    token = logits[0, -1].argmax()
    t0 = synced_time(target.device)
    while not emit_tokens(out, [int(token)], max_new_tokens, stop_ids):
        logits = target.model(input_ids=token.view(1, 1), past_key_values=cache, use_cache=True).logits
        token = logits[0, -1].argmax()
    return DecodeResult(tokens=out, decode_seconds=synced_time(target.device) - t0)


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
    context token precedes the block, so no mask is needed.
    """
    device = block_ids.device
    ctx_positions = torch.arange(cache.length, start, device=device)[None]
    block_positions = torch.arange(start, start + block_ids.shape[0], device=device)[None]
    assert ctx_positions.shape[1] == context_new.shape[1], "context features out of step with positions"
    return drafter(context_new, target.embed_weight[block_ids][None], ctx_positions, block_positions, mask=None,
                   cache=cache)


def propose(drafter: DFlashDraftModel, target: Target, hidden: torch.Tensor, block_ids: torch.Tensor,
            temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(proposals [b, B-1], their draft logits or None at temperature 0) of blocks [b, B] from the
    drafter's hidden states [b, B, H]: greedy as the drafter's family drafts (DFlash2's selector walks
    its candidates), else a sample of each slot's distribution (DFlash only)."""
    if temperature == 0:
        return drafter.propose_greedy(hidden, target.lm_head_weight, block_ids), None
    if drafter.config.family != "dflash":
        raise ValueError(f"temperature {temperature}: sampled drafting is implemented for family dflash only; "
                         f"evaluate {drafter.config.family} at temperature 0")
    logits = hidden[:, 1:] @ target.lm_head_weight.T
    return sample_tokens(logits, temperature, generator), logits


def accept_greedy(proposals: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """(accepted proposals n, the target's token after them) at temperature 0.

    target_logits[k] predicts the token after block slot k, so it checks proposal k (slot k+1).
    """
    choice = target_logits.argmax(-1)  # [B]
    n = int((proposals == choice[:-1]).cumprod(0).sum())
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
) -> SpecResult:
    """Decode `input_ids` [1, P] with DFlash drafting and target verification (lossless).

    At temperature 0 the output equals `target_greedy` token for token; above it every token is a
    target sample (speculative sampling). `generator` must live on the target's device.
    """
    assert input_ids.shape[0] == 1, "speculative decoding here is one sequence at a time"
    check_budget(max_new_tokens)
    cfg = drafter.config
    block_size = block_size or cfg.block_size
    layer_ids, stop_ids = cfg.target_layer_ids, set(stop_ids)
    device = input_ids.device

    target_cache = DynamicCache(config=target.model.config)
    target_cache.activate_past_recording()  # a sliding layer keeps the block until `crop`, so it can drop rejections
    logits, context_new = _target_forward(target, input_ids, target_cache, layer_ids, keep=1)  # no [P, V] logits
    out: list[int] = []
    result = SpecResult(tokens=out, decode_seconds=0.0, block_size=block_size, position_accepts=[0] * (block_size - 1))
    token = int(sample_tokens(logits[-1], temperature, generator))
    if emit_tokens(out, [token], max_new_tokens, stop_ids):
        return result

    draft_cache = DraftKVCache(cfg.num_hidden_layers)
    start = input_ids.shape[1]  # position of `token`, the block's slot 0
    t0 = synced_time(device)
    while True:
        block = torch.full((block_size,), cfg.mask_token_id, dtype=torch.long, device=device)
        block[0] = token
        hidden = draft_block(drafter, target, block, start, context_new, draft_cache)
        proposals, draft_logits = propose(drafter, target, hidden, block[None], temperature, generator)
        block[1:] = proposals[0]
        target_logits, features = _target_forward(target, block[None], target_cache, layer_ids)
        if temperature == 0:
            n, token = accept_greedy(block[1:], target_logits)
        else:
            q = torch.softmax(draft_logits[0].float() / temperature, dim=-1)
            p = torch.softmax(target_logits.float() / temperature, dim=-1)
            n, token = accept_sampled(block[1:], q, p, generator)
        result.acceptance_lengths.append(n + 1)
        for k in range(n):
            result.position_accepts[k] += 1
        # Keep the target's cache and features for slot 0 and the n accepted proposals; `token`
        # (bonus/correction) is the next block's slot 0 at position start + n + 1.
        start += n + 1
        target_cache.crop(-(block_size - n - 1))  # negative = tokens to drop (transformers >= 5.17)
        context_new = features[:, : n + 1]
        if emit_tokens(out, block[1 : n + 1].tolist() + [token], max_new_tokens, stop_ids):
            break
    result.decode_seconds = synced_time(device) - t0
    return result
