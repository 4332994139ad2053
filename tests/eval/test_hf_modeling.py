"""z-lab's route: an export loads through `AutoModel.from_pretrained(export, trust_remote_code=True)`
from its own modeling file, and computes what our drafter computes (DFlash and DFlash2)."""

from __future__ import annotations

import ast
import json

import pytest
import torch
from transformers import AutoModel, DynamicCache

from dflash_train.draft import masks
from dflash_train.draft.build import drafter_for
from dflash_train.draft.model import DraftModelConfig
from dflash_train.eval.export import MODELING_FILE, export_drafter

from .test_export import save_checkpoint


def config(family: str, sliding_window: int | None = None) -> DraftModelConfig:
    dflash2 = dict(conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=3) if family == "dflash2" else {}
    return DraftModelConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            intermediate_size=48, num_hidden_layers=2, vocab_size=50, block_size=4,
                            target_layer_ids=[0, 2], num_target_layers=4, mask_token_id=3, rope_theta=10000.0,
                            family=family, sliding_window=sliding_window, **dflash2)


def trained(family: str, sliding_window: int | None = None):
    """A drafter whose every weight is off its initial value (identity convolutions, unit norms and a
    zero codebook would hide a mix-up), rounded to bf16 as the export stores it."""
    torch.manual_seed(0)
    drafter = drafter_for(config(family, sliding_window))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
            p.copy_(p.bfloat16().float())
    return drafter.eval()


def test_the_modeling_file_needs_only_torch_and_transformers():
    tree = ast.parse(MODELING_FILE.read_text())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert roots <= {"__future__", "torch", "transformers"}, roots


@pytest.mark.parametrize("family, architecture", [("dflash", "DFlashDraftModel"), ("dflash2", "DFlash2DraftModel")])
def test_transformers_loads_the_export_as_our_drafter(family, architecture, tmp_path):
    ours = trained(family)
    out = export_drafter(save_checkpoint(ours, tmp_path / "ckpt"), tmp_path / family)
    assert json.loads((out / "config.json").read_text())["auto_map"] == {"AutoModel": f"dflash.{architecture}"}

    theirs = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(theirs).__name__ == architecture
    assert set(theirs.state_dict()) == set(ours.state_dict())

    g = torch.Generator().manual_seed(1)
    ctx = torch.randn(2, 5, 2 * 32, generator=g)  # two captured layers of the target, 5 context tokens
    block = torch.randn(2, 8, 32, generator=g)  # two blocks of 4 (DFlash2 convolves each alone)
    ctx_pos = torch.arange(3, 8).repeat(2, 1)
    block_pos = torch.arange(8, 16).repeat(2, 1)
    with torch.no_grad():
        expected = ours(ctx, block, ctx_pos, block_pos)
        got = theirs(position_ids=torch.cat([ctx_pos, block_pos], dim=1), noise_embedding=block, target_hidden=ctx)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    lm_head = torch.randn(50, 32, generator=g)  # the target's: the drafts' logits are its LM head of the hidden
    torch.testing.assert_close(got @ lm_head.T, expected @ lm_head.T, rtol=1e-5, atol=1e-4)
    if family == "dflash2":  # the greedy drafts through the selector
        first = expected[:, :4]
        anchors = torch.tensor([7, 9])
        want = ours.propose_greedy(first, lm_head, torch.stack([anchors, anchors], 1))
        slots = got[:, 1:4]
        assert torch.equal(theirs.candidate_selector.walk(slots, slots @ lm_head.T, anchors), want)


@pytest.mark.parametrize("family", ["dflash", "dflash2"])
def test_transformers_applies_the_exports_window(family, tmp_path):
    """A block at positions 12..15 over 12 context tokens in a window of 6: our decoders' mask
    (`decode_mask`) and the modeling file's, with and without a cache, give the same drafts."""
    window, start = 6, 12
    ours = trained(family, sliding_window=window)
    out = export_drafter(save_checkpoint(ours, tmp_path / "ckpt"), tmp_path / family)
    theirs = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()

    g = torch.Generator().manual_seed(2)
    ctx = torch.randn(2, start, 2 * 32, generator=g)
    block = torch.randn(2, 4, 32, generator=g)
    ctx_pos, block_pos = torch.arange(start).repeat(2, 1), torch.arange(start, start + 4).repeat(2, 1)
    mask = masks.decode_mask(block_pos[:, 0], start, 4, window)
    with torch.no_grad():
        expected = ours(ctx, block, ctx_pos, block_pos, mask=mask)
        whole_context = ours(ctx, block, ctx_pos, block_pos)
        got = theirs(position_ids=torch.cat([ctx_pos, block_pos], dim=1), noise_embedding=block, target_hidden=ctx)
        # z-lab's rounds: positions 0..7 cached with an earlier block at 8..11, then 8..11 new
        cache = DynamicCache()
        theirs(position_ids=torch.arange(12).repeat(2, 1), noise_embedding=block, target_hidden=ctx[:, :8],
               past_key_values=cache, use_cache=True)
        cache.crop(-4)  # drop the earlier block's keys
        cached = theirs(position_ids=torch.cat([ctx_pos[:, 8:], block_pos], dim=1), noise_embedding=block,
                        target_hidden=ctx[:, 8:], past_key_values=cache, use_cache=True)
    assert not torch.allclose(expected, whole_context, atol=1e-3)  # the window matters here
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached, expected, rtol=1e-5, atol=1e-5)
