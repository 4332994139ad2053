"""DFlash2 against brute-force references written from the serving engines' code (float64 loops)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from dflash_train.draft.build import drafter_for
from dflash_train.draft.dflash2 import DFlash2DraftModel, GroupedConv
from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig
from dflash_train.eval.export import draft_config_from_export, export_config
from draft.helpers_draft import randomize_selector, rounds_cut_by_p_min


def config(**kw) -> DraftModelConfig:
    base = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                num_hidden_layers=2, vocab_size=50, block_size=4, target_layer_ids=[0, 2], num_target_layers=4,
                mask_token_id=3, family="dflash2", conv_kernel_size=2, conv_group_size=8, selector_rank=6,
                selector_top_k=3)
    return DraftModelConfig(**{**base, **kw})


def conv_reference(x, coeff, base, side, block, group):
    """llama.cpp's build_dflash2_conv, one output element at a time."""
    b, q, h = x.shape
    out = torch.zeros_like(x)
    for r in range(b):
        for t in range(q):
            p = t % block
            for c in range(h):
                for tap in range(base.shape[1]):
                    if p >= tap:
                        out[r, t, c] += (base[side, tap, c] + coeff[r, t, side, tap, c // group]) * x[r, t - tap, c]
    return out


@pytest.mark.parametrize("taps", [1, 2, 3, 6])
def test_grouped_conv_matches_the_engines_loop(taps):
    cfg = config(conv_kernel_size=taps)
    conv = GroupedConv(cfg).double()
    torch.manual_seed(0)
    torch.nn.init.normal_(conv.base_kernel)
    torch.nn.init.normal_(conv.kernel_projection.weight)
    x = torch.randn(2, 3 * cfg.block_size, cfg.hidden_size, dtype=torch.float64)
    coeff = conv.coefficients(x)
    for side in (0, 1):
        got = conv.convolve(x, coeff, side, cfg.block_size)
        want = conv_reference(x, coeff, conv.base_kernel, side, cfg.block_size, cfg.conv_group_size)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("taps,group", [(3, 16), (2, 8)], ids=["12-outputs-padded", "16-outputs"])
def test_coefficients_are_the_projection_at_any_width(taps, group):
    """A width that is not a multiple of 8 is computed with zero rows padded to the weight: the
    coefficients and the weight's gradient are the plain projection's."""
    conv = GroupedConv(config(conv_kernel_size=taps, conv_group_size=group)).double()
    torch.manual_seed(0)
    torch.nn.init.normal_(conv.kernel_projection.weight)
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    got = conv.coefficients(x)
    want = (x @ conv.kernel_projection.weight.T).unflatten(-1, (2, taps, 32 // group))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad = torch.randn_like(want)
    (got_grad,) = torch.autograd.grad(got, conv.kernel_projection.weight, grad)
    (want_grad,) = torch.autograd.grad(want, conv.kernel_projection.weight, grad)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-12)


def walk_reference(sel, hidden, logits, anchor, p_min: float = 0.0):
    """llama.cpp's selector lattice and CPU walk (common/speculative.cpp), position by position; with
    `p_min` the walk stops before the first position whose softmax at the argmax, 1 / sum(exp(s_k - s_max)),
    is below it."""
    path, prev = [], int(anchor)
    for i in range(hidden.shape[0]):
        unary, ids = logits[i].topk(sel.top_k)
        gate = sel.hidden_projection(hidden[i])
        scores = [float(unary[c] + (sel.predecessor_codebook[prev] * gate * sel.successor_codebook[ids[c]]).sum())
                  for c in range(sel.top_k)]
        best = max(range(sel.top_k), key=scores.__getitem__)
        if p_min > 0 and 1 / sum(math.exp(s - scores[best]) for s in scores) < p_min:
            break
        prev = int(ids[best])
        path.append(prev)
    return path


def random_selector_problem(seed: int, rows: int = 5, block_size: int = 4):
    """A float64 DFlash2 drafter with a random selector, and random slots, head and blocks."""
    cfg = config(block_size=block_size)
    model = DFlash2DraftModel(cfg).double()
    torch.manual_seed(seed)
    randomize_selector(model)
    hidden = torch.randn(rows, cfg.block_size, cfg.hidden_size, dtype=torch.float64)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.float64)
    blocks = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size))
    return model, hidden, head, blocks


def test_the_selector_walk_matches_the_engines_loop():
    model, hidden, head, blocks = random_selector_problem(seed=1)
    got = model.propose_greedy(hidden, head, blocks)
    for r in range(5):
        slots = hidden[r, 1:]
        assert got[r].tolist() == walk_reference(model.candidate_selector, slots, slots @ head.T, blocks[r, 0])


def test_the_draft_cut_at_p_min_matches_the_engines_loop():
    """--spec-draft-p-min on a DFlash2 draft: the walk stops at its first position of lower confidence."""
    model, hidden, head, blocks = random_selector_problem(seed=4, rows=40, block_size=8)
    proposals = model.propose_greedy(hidden, head, blocks)
    cuts = []
    for p_min in (0.6, 0.9, 0.99):
        got = model.draft_limits(hidden, head, blocks, proposals, p_min)
        for r in range(40):
            slots = hidden[r, 1:]
            kept = walk_reference(model.candidate_selector, slots, slots @ head.T, blocks[r, 0], p_min)
            assert int(got[r]) == len(kept) and proposals[r, : len(kept)].tolist() == kept
        cuts.append(got.sum().item())
    assert 0 < cuts[-1] < cuts[0] < 40 * 7  # some drafts cut, more at a higher threshold, not all


def test_decoding_with_p_min_stops_where_the_selector_is_unsure_and_stays_lossless():
    """Both decoders cut the same rounds where the selector's confidence says (held to the engine's loop
    above), accept nothing past a cut, and answer as the target alone does."""
    from tests.eval.tiny_models import tiny_drafter, tiny_target

    target = tiny_target()
    v1 = tiny_drafter(target, block_size=6)
    cfg = DraftModelConfig(**{**vars(v1.config), "family": "dflash2", "conv_kernel_size": 2, "conv_group_size": 16,
                              "selector_rank": 8, "selector_top_k": 4})
    drafter = DFlash2DraftModel(cfg).eval().requires_grad_(False)
    drafter.load_state_dict(v1.state_dict(), strict=False)
    torch.manual_seed(6)
    randomize_selector(drafter, std=0.5)
    assert rounds_cut_by_p_min(target, drafter, 0.6) > 0


def test_a_fresh_dflash2_drafts_as_the_dflash_drafter_it_holds():
    v1_cfg = config(family="dflash", conv_kernel_size=0, conv_group_size=0, selector_rank=0, selector_top_k=0)
    torch.manual_seed(2)
    v1 = DFlashDraftModel(v1_cfg).double()
    v2 = DFlash2DraftModel(config()).double()
    missing, unexpected = v2.load_state_dict(v1.state_dict(), strict=False)
    assert not unexpected and all("conv" in n or "candidate_selector" in n for n in missing)
    v2.reset_dflash2()
    ctx = torch.randn(2, 6, 2 * 32, dtype=torch.float64)
    blocks = torch.randn(2, 8, 32, dtype=torch.float64)
    ctx_pos, blk_pos = torch.arange(6).expand(2, 6), torch.arange(6, 14).expand(2, 8)
    torch.testing.assert_close(v2(ctx, blocks, ctx_pos, blk_pos), v1(ctx, blocks, ctx_pos, blk_pos))
    head = torch.randn(50, 32, dtype=torch.float64)
    hidden = v1(ctx, blocks[:, :4], ctx_pos, blk_pos[:, :4])
    ids = torch.zeros(2, 4, dtype=torch.long)
    assert torch.equal(v2.propose_greedy(hidden, head, ids), v1.propose_greedy(hidden, head, ids))


def test_the_export_names_and_fields_are_the_engines(tmp_path):
    cfg = config()
    with torch.device("meta"):
        names = set(drafter_for(cfg).state_dict())
    assert {"layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
            "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= names
    written = export_config(cfg)
    assert written["architectures"] == ["DFlash2DraftModel"]
    assert {k: written["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                     "selector_top_k", "block_size")} == \
        {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 3, "block_size": 4}
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert draft_config_from_export(tmp_path) == cfg


def test_bad_dflash2_sizes_are_refused_in_one_line():
    with pytest.raises(ValueError, match="dividing hidden_size"):
        config(conv_group_size=5)
    with pytest.raises(ValueError, match="k\\*\\(k\\+1\\)"):
        config(selector_top_k=6)
    with pytest.raises(ValueError, match="belong to family dflash2"):
        config(family="dflash")


def test_training_the_selector_picks_the_successor_its_predecessor_calls_for():
    """Two candidates with equal logits; which one comes next depends on the previous token only. The
    drafter's logits cannot tell them apart; the trained selector walks the right path."""
    from dflash_train.draft.dflash2 import selector_inputs
    from dflash_train.draft.loss import LossMix, block_loss

    cfg = config(block_size=3, selector_top_k=2)
    model = DFlash2DraftModel(cfg)
    head = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    # 10 and 11 tie as every slot's top 2; 20 and 21, a little lower, join slot 2 as its labels. Were all
    # four tied, which two the top-k takes would decide whether 10 and 11 ever met in training
    head[10, 0] = head[11, 0] = 1.01
    head[20, 0] = head[21, 0] = 1.0
    hidden = torch.zeros(4, 3, cfg.hidden_size)
    hidden[..., 0] = 1.0
    hidden[..., 1] = 1.0  # a constant gate input
    anchors = torch.tensor([1, 2, 1, 2])
    block_ids = torch.stack([anchors, torch.full_like(anchors, 3), torch.full_like(anchors, 3)], 1)
    # anchor 1 -> 10 -> 20, anchor 2 -> 11 -> 21
    labels = torch.stack([anchors, torch.where(anchors == 1, 10, 11), torch.where(anchors == 1, 20, 21)], 1)
    weights = torch.tensor([[0.0, 1.0, 1.0]]).expand(4, 3)
    opt = torch.optim.Adam(model.candidate_selector.parameters(), lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        inputs = selector_inputs(model, hidden, block_ids, labels, weights)
        block_loss(hidden, head, labels, weights, 3, mix=LossMix(ce=0.0, selector=1.0), selector=inputs).weighted_ce_sum.backward()
        opt.step()
    with torch.no_grad():
        path = model.propose_greedy(hidden, head, block_ids)
    assert path[:, 0].tolist() == [10, 11, 10, 11]


@pytest.mark.parametrize("overrides, named", [
    (["draft.dflash2.selector_rank=8"], "draft.dflash2.selector_rank belongs to draft.family=dflash2"),
    (["draft.family=dflash2"], "add selector to objective.loss"),
    (["objective.loss={ce: 1, selector: 1}"], "set draft.family=dflash2"),
    (["draft.family=dflash2", "objective.loss={ce: 1, selector: 1}", "train.fp8_lm_head=true"], "fp8_lm_head"),
    (["draft.family=dflash2", "objective.loss={ce: 1, selector: 1}", "draft.fp8=tensorwise"], "set draft.fp8=off"),
])
def test_the_family_keys_are_read_or_refused_in_one_line(overrides, named):
    from dflash_train.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=re.escape(named)):
        build_config({}, overrides)
    build_config({}, ["draft.family=dflash2", "objective.loss={ce: 1, selector: 1}", "draft.dflash2.selector_rank=8"])
