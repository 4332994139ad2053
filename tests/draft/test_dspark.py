"""DSpark against brute-force references written from llama.cpp's code (float64 loops): the greedy
chain, the loss with its gradients in the chunked pass (chunks cutting blocks), the warm start, the
export's names and keys, and the config's one-line refusals."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dflash_train.draft.build import drafter_for
from dflash_train.draft.dspark import DSparkDraftModel
from dflash_train.draft.loss import LossMix, block_loss
from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig
from dflash_train.eval.export import draft_config_from_export, export_config

BLOCK = 4


def config(**kw) -> DraftModelConfig:
    base = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                num_hidden_layers=1, vocab_size=50, block_size=BLOCK, target_layer_ids=[0, 2], num_target_layers=4,
                mask_token_id=3, family="dspark", markov_rank=6)
    return DraftModelConfig(**{**base, **kw})


def trained_head(seed: int) -> DSparkDraftModel:
    """A float64 DSpark drafter whose Markov head is not the fresh (zero) one."""
    model = DSparkDraftModel(config()).double()
    torch.manual_seed(seed)
    for p in model.markov_head.parameters():
        torch.nn.init.normal_(p)
    return model


@torch.no_grad()
def chain_reference(model, logits, anchor):
    """llama.cpp's build_dspark_markov_head with sample_from_anchor=false and the draft loop of
    common/speculative.cpp at T=0: position i's logits plus w2 . w1[prev], prev the argmax before."""
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    path, prev = [], int(anchor)
    for i in range(logits.shape[0]):
        col = [float(logits[i, v] + (w2[v] * w1[prev]).sum()) for v in range(logits.shape[1])]
        prev = max(range(len(col)), key=col.__getitem__)
        path.append(prev)
    return path


def test_the_greedy_chain_matches_the_engines_loop():
    model = trained_head(0)
    hidden = torch.randn(5, BLOCK, 32, dtype=torch.float64)
    head = torch.randn(50, 32, dtype=torch.float64)
    blocks = torch.randint(0, 50, (5, BLOCK))
    got = model.propose_greedy(hidden, head, blocks)
    for r in range(5):
        assert got[r].tolist() == chain_reference(model, hidden[r, 1:] @ head.T, blocks[r, 0])
    # the bias matters here: the backbone's own argmax drafts another path
    assert not torch.equal(got, (hidden[:, 1:] @ head.T).argmax(-1))


def test_a_fresh_dspark_drafts_as_the_dflash_drafter_it_holds():
    torch.manual_seed(2)
    v1 = DFlashDraftModel(config(family="dflash", markov_rank=0)).double()
    spark = DSparkDraftModel(config()).double()
    missing, unexpected = spark.load_state_dict(v1.state_dict(), strict=False)
    assert not unexpected and all(n.startswith("markov_head.") for n in missing)
    spark.reset_own_parts()
    ctx = torch.randn(2, 6, 2 * 32, dtype=torch.float64)
    blocks = torch.randn(2, BLOCK, 32, dtype=torch.float64)
    ctx_pos, blk_pos = torch.arange(6).expand(2, 6), torch.arange(6, 6 + BLOCK).expand(2, BLOCK)
    hidden = v1(ctx, blocks, ctx_pos, blk_pos)
    torch.testing.assert_close(spark(ctx, blocks, ctx_pos, blk_pos), hidden)
    head = torch.randn(50, 32, dtype=torch.float64)
    ids = torch.zeros(2, BLOCK, dtype=torch.long)
    assert torch.equal(spark.propose_greedy(hidden, head, ids), v1.propose_greedy(hidden, head, ids))


def problem(seed: int, b: int = 2, blocks: int = 3):
    g = torch.Generator().manual_seed(seed)
    q = blocks * BLOCK
    hidden = torch.randn(b, q, 32, generator=g)
    head = torch.randn(50, 32, generator=g)
    block_ids = torch.randint(0, 50, (b, q), generator=g)
    labels = torch.randint(0, 50, (b, q), generator=g)
    weights = torch.rand(b, q, generator=g) * (torch.arange(q) % BLOCK != 0)
    weights[1, 7] = 0  # a slot that does not count
    t_hidden = torch.randn(b, q, 32, generator=g)
    return hidden, head, block_ids, labels, weights, t_hidden


def reference(model, hidden, head, block_ids, labels, weights, t_hidden, mix: LossMix):
    """(loss, per-row 1.0 where the biased argmax is the checked token), slot by slot: each slot's
    logits plus the bias after its true previous token, every term of the mix on them."""
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    total, correct = hidden.new_zeros(()), torch.zeros_like(weights)
    for r in range(hidden.shape[0]):
        for t in range(hidden.shape[1]):
            if weights[r, t] <= 0:
                continue
            prev = int(block_ids[r, t - 1]) if t % BLOCK == 1 else int(labels[r, t - 1])
            z = hidden[r, t] @ head.T + w2 @ w1[prev]
            t_logits = t_hidden[r, t] @ head.T
            ref = int(t_logits.argmax())
            log_q = torch.log_softmax(z, -1)
            temp = mix.temperature
            log_p = torch.log_softmax(t_logits / temp, -1)
            kl = (log_p.exp() * (log_p - torch.log_softmax(z / temp, -1))).sum()
            l1 = (log_q.exp() - torch.softmax(t_logits, -1)).abs().sum()
            row = (-mix.ce * log_q[labels[r, t]] - mix.target_argmax * log_q[ref] + mix.kl * temp * temp * kl
                   + mix.l1 * l1)
            total = total + weights[r, t] * row
            correct[r, t] = float(int(z.argmax()) == ref)
    return total, correct


@pytest.mark.parametrize("chunk", [5, 7, 24])
def test_the_loss_and_its_gradients_match_the_slot_by_slot_reference(chunk):
    """The chunked pass (fp32) against the float64 reference; chunks of 5 and 7 rows cut the blocks of
    4, and the projection's gradient sums over chunks."""
    mix = LossMix(ce=0.3, target_argmax=0.2, kl=0.5, temperature=0.7, l1=0.4)
    hidden, head, block_ids, labels, weights, t_hidden = problem(seed=chunk)
    model64 = trained_head(1)
    model = trained_head(1).float()
    h64 = hidden.double().requires_grad_()
    want, want_correct = reference(model64, h64, head.double(), block_ids, labels, weights.double(),
                                   t_hidden.double(), mix)
    hidden.requires_grad_()
    out = block_loss(hidden, head, labels, weights, BLOCK, chunk, mix, t_hidden, lambda x: x @ head.T,
                     bias=model.logit_bias(block_ids, labels))
    torch.testing.assert_close(out.weighted_ce_sum.double(), want, rtol=1e-5, atol=1e-5)
    params = lambda m, h: [h, m.markov_head.markov_w1.weight, m.markov_head.markov_w2.weight]  # noqa: E731
    got = torch.autograd.grad(out.weighted_ce_sum, params(model, hidden))
    for mine, theirs in zip(got, torch.autograd.grad(want, params(model64, h64)), strict=True):
        torch.testing.assert_close(mine.double(), theirs, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.correct_per_slot, want_correct.view(-1, BLOCK).sum(0).float())


def test_training_the_markov_head_drafts_the_successor_its_predecessor_calls_for():
    """Two tokens tie in the backbone's logits at every slot; which comes next depends on the previous
    token only. The trained Markov head makes the greedy chain follow it."""
    cfg = config(block_size=3)
    model = DSparkDraftModel(cfg)
    head = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    head[10, 0] = head[11, 0] = head[20, 0] = head[21, 0] = 1.0
    hidden = torch.zeros(4, 3, cfg.hidden_size)
    hidden[..., 0] = 1.0
    anchors = torch.tensor([1, 2, 1, 2])
    block_ids = torch.stack([anchors, torch.full_like(anchors, 3), torch.full_like(anchors, 3)], 1)
    labels = torch.stack([anchors, torch.where(anchors == 1, 10, 11), torch.where(anchors == 1, 20, 21)], 1)
    weights = torch.tensor([[0.0, 1.0, 1.0]]).expand(4, 3)
    opt = torch.optim.Adam(model.markov_head.parameters(), lr=0.05)
    for _ in range(100):
        opt.zero_grad()
        bias = model.logit_bias(block_ids, labels)
        block_loss(hidden, head, labels, weights, 3, bias=bias).weighted_ce_sum.backward()
        opt.step()
    assert model.propose_greedy(hidden, head, block_ids).tolist() == [[10, 20], [11, 21], [10, 20], [11, 21]]


def test_the_export_names_and_keys_are_llama_cpps(tmp_path):
    cfg = config()
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in drafter_for(cfg).state_dict().items()}
    # the converter maps model.markov_head.markov_w{1,2} (gguf-py tensor_mapping.py); ggml's [R, V] is torch's [V, R]
    assert shapes["markov_head.markov_w1.weight"] == shapes["markov_head.markov_w2.weight"] == (50, 6)
    written = export_config(cfg)
    assert written["architectures"] == ["DSparkDraftModel"]
    assert (written["sample_from_anchor"], written["markov_head_type"]) == (False, "vanilla")
    assert {k: written["dflash_config"][k] for k in ("block_size", "markov_rank")} == \
        {"block_size": 4, "markov_rank": 6}
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert draft_config_from_export(tmp_path) == cfg


def test_bad_dspark_sizes_and_d_pace_are_refused_in_one_line():
    with pytest.raises(ValueError, match="belong to family dspark"):
        config(family="dflash")
    hidden, head, block_ids, labels, weights, _ = problem(seed=0)
    with pytest.raises(ValueError, match="objective.slot_weights=decay"):
        block_loss(hidden, head, labels, weights, BLOCK, mix=LossMix(dpace_alpha=0.5),
                   bias=trained_head(0).logit_bias(block_ids, labels))


@pytest.mark.parametrize("overrides, named", [
    (["draft.dspark.markov_rank=8"], "draft.dspark.markov_rank belongs to draft.family=dspark"),
    (["draft.family=dspark", "objective.loss={ce: 1, selector: 1}"], "set draft.family=dflash2"),
    (["draft.family=dspark", "objective.slot_weights=dpace"], "objective.slot_weights=decay"),
    (["draft.family=dspark", "train.ce_kernel=liger"], "only the chunked kernel adds its logit bias"),
])
def test_the_family_keys_are_read_or_refused_in_one_line(overrides, named):
    from dflash_train.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=re.escape(named)):
        build_config({}, overrides)
    build_config({}, ["draft.family=dspark", "draft.dspark.markov_rank=8"])
