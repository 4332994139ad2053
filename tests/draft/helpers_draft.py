"""Small drafter configs shared by the draft tests (no target, no pydantic: also imported on GPU)."""

from __future__ import annotations

import torch

from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig


def tiny_draft_config(**overrides) -> DraftModelConfig:
    kw = dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        num_hidden_layers=2, vocab_size=61, block_size=4, target_layer_ids=[0, 2], num_target_layers=4,
        mask_token_id=60,
    )
    kw.update(overrides)
    return DraftModelConfig(**kw)


def tiny_drafter(seed: int = 0, **overrides) -> DFlashDraftModel:
    torch.manual_seed(seed)
    return DFlashDraftModel(tiny_draft_config(**overrides)).eval()


def randomize_selector(model, std: float = 1.0) -> None:
    """Draw a DFlash2 drafter's selector (both codebooks, then the gate's projection) from N(0, std): a fresh
    successor codebook is zero, so every candidate would score its logit alone."""
    sel = model.candidate_selector
    for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
        torch.nn.init.normal_(p, std=std)


def rounds_cut_by_p_min(target, drafter: DFlashDraftModel, p_min: float) -> int:
    """Rounds whose draft `p_min` cut short on three prompts, after checking that both decoders cut the same
    rounds, accept nothing past a cut, answer as the target alone does, and cut nothing when it is 0."""
    from dflash_train.decode.batched import batched_speculative
    from dflash_train.decode.spec_decode import speculative_generate, target_greedy

    prompts, full = [[5, 9, 14, 3, 7], [11, 2, 8], [40, 41, 42, 43]], drafter.config.block_size - 1
    cut = 0
    for prompt, result in zip(prompts, batched_speculative(target, drafter, prompts, 24, draft_p_min=p_min)):
        ids = torch.tensor([prompt])
        assert result.tokens == target_greedy(target, ids, 24).tokens
        one = speculative_generate(target, drafter, ids, 24, draft_p_min=p_min)
        assert (one.tokens, one.acceptance_lengths, one.draft_lengths) == \
            (result.tokens, result.acceptance_lengths, result.draft_lengths)
        assert all(n - 1 <= d for n, d in zip(result.acceptance_lengths, result.draft_lengths))
        cut += sum(d < full for d in result.draft_lengths)
    assert all(d == full for r in batched_speculative(target, drafter, prompts, 24) for d in r.draft_lengths)
    return cut
