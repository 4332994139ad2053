"""DSpark's confidence head against references written from llama.cpp's code (float64 loops): the head's
formula, the draft cut of --spec-draft-p-min, the BCE term with its gradients in the chunked pass, the
decoders' rounds under a threshold, the export's names and keys, and the config's one-line refusals."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.decode.batched import batched_speculative
from dflash_train.draft.build import drafter_for
from dflash_train.draft.dspark import DSparkDraftModel
from dflash_train.draft.loss import LossMix, block_loss
from dflash_train.eval.export import draft_config_from_export, export_config
from draft.helpers_draft import rounds_cut_by_p_min

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the DSpark tests beside this file
from test_dspark import BLOCK, config, problem  # noqa: E402


def with_head(seed: int, **kw) -> DSparkDraftModel:
    """A float64 DSpark drafter whose Markov and confidence heads are random (not the fresh ones)."""
    model = DSparkDraftModel(config(confidence_head=True, **kw)).double()
    torch.manual_seed(seed)
    for p in (*model.markov_head.parameters(), *model.confidence_head.parameters()):
        torch.nn.init.normal_(p)
    return model


@torch.no_grad()
def confidence_reference(model, h, prev) -> float:
    """conf = sigmoid(conf_proj . [h; markov_w1[prev]] + b), src/models/dflash.cpp build_dspark_markov_head."""
    w, b = model.confidence_head.proj.weight[0], model.confidence_head.proj.bias[0]
    feat = list(h.tolist()) + model.markov_head.markov_w1.weight[prev].tolist()
    return 1 / (1 + math.exp(-(sum(wi * fi for wi, fi in zip(w.tolist(), feat)) + float(b))))


def test_the_head_and_the_draft_cut_match_the_engines_formula():
    model = with_head(0)
    hidden = torch.randn(6, BLOCK, 32, dtype=torch.float64)
    head = torch.randn(50, 32, dtype=torch.float64)
    blocks = torch.randint(0, 50, (6, BLOCK))
    proposals = model.propose_greedy(hidden, head, blocks)
    confs = [[confidence_reference(model, hidden[r, 1 + i], int(blocks[r, 0] if i == 0 else proposals[r, i - 1]))
              for i in range(BLOCK - 1)] for r in range(6)]
    prev = torch.cat([blocks[:, :1], proposals[:, :-1]], 1)
    got = torch.sigmoid(model.confidence_head(hidden[:, 1:], model.markov_head.markov_w1(prev)))
    torch.testing.assert_close(got, torch.tensor(confs, dtype=torch.float64))
    for p_min in (0.2, 0.5, 0.8):
        # common/speculative.cpp: `if (conf[idx] < p_min) break;` before the slot is drafted
        want = [next((i for i, c in enumerate(row) if c < p_min), BLOCK - 1) for row in confs]
        assert model.draft_limits(hidden, head, blocks, proposals, p_min).tolist() == want
    assert 0 < sum(want) < 6 * (BLOCK - 1)  # some drafts are cut, not all


def bce_reference(model, hidden, head, block_ids, labels, weights):
    """sum_w BCE(conf, 1[biased argmax == label]) slot by slot, the previous token the true one."""
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    total = hidden.new_zeros(())
    for r in range(hidden.shape[0]):
        for t in range(hidden.shape[1]):
            if weights[r, t] <= 0:
                continue
            prev = int(block_ids[r, t - 1]) if t % BLOCK == 1 else int(labels[r, t - 1])
            z = hidden[r, t] @ head.T + w2 @ w1[prev]
            label = float(int(z.argmax()) == int(labels[r, t]))
            feat = torch.cat([hidden[r, t], w1[prev]])
            c = torch.sigmoid(model.confidence_head.proj.weight[0] @ feat + model.confidence_head.proj.bias[0])
            total = total - weights[r, t] * (label * torch.log(c) + (1 - label) * torch.log(1 - c))
    return total


@pytest.mark.parametrize("chunk", [5, 24])
def test_the_bce_term_and_its_gradients_match_float64_autograd(chunk):
    hidden, head, block_ids, labels, weights, _ = problem(seed=chunk)
    labels[0, 1:4] = (hidden[0, 1:4] @ head.T).argmax(-1)  # some slots right, so both labels occur
    model64, model = with_head(3), with_head(3).float()
    mix = LossMix(ce=1.0, confidence=0.7)
    h64 = hidden.double().requires_grad_()
    want = bce_reference(model64, h64, head.double(), block_ids, labels, weights.double())
    ce_only = block_loss(hidden, head, labels, weights, BLOCK, chunk, LossMix(ce=1.0),
                         bias=model.logit_bias(block_ids, labels)).weighted_ce_sum
    hidden.requires_grad_()
    bias = model.logit_bias(block_ids, labels)
    conf = (model.confidence_logits(hidden.flatten(0, 1), bias.code), mix.confidence * weights)
    out = block_loss(hidden, head, labels, weights, BLOCK, chunk, mix, bias=bias, confidence=conf)
    torch.testing.assert_close((out.weighted_ce_sum - ce_only).double(), 0.7 * want, rtol=1e-5, atol=1e-5)
    params = lambda m, h: [h, m.markov_head.markov_w1.weight, m.markov_head.markov_w2.weight,  # noqa: E731
                           m.confidence_head.proj.weight, m.confidence_head.proj.bias]
    ce64 = _ce64(model64, h64, head.double(), block_ids, labels, weights.double())
    got = torch.autograd.grad(out.weighted_ce_sum, params(model, hidden))
    for mine, theirs in zip(got, torch.autograd.grad(ce64 + 0.7 * want, params(model64, h64)), strict=True):
        torch.testing.assert_close(mine.double(), theirs, rtol=1e-4, atol=1e-5)


def _ce64(model, hidden, head, block_ids, labels, weights):
    """The CE part in float64, the same chunk-free way (draft/loss.py is checked in test_dspark.py)."""
    bias = model.logit_bias(block_ids, labels)
    z = hidden.flatten(0, 1) @ head.T + bias.code @ bias.proj.T
    ce = torch.nn.functional.cross_entropy(z, labels.reshape(-1), reduction="none")
    return (ce * weights.reshape(-1)).sum()


def test_decoding_with_p_min_stops_where_the_head_says_and_stays_lossless():
    from tests.eval.tiny_models import tiny_drafter, tiny_target

    target = tiny_target()
    v1 = tiny_drafter(target)
    drafter = DSparkDraftModel(config(**{**vars(v1.config), "family": "dspark", "markov_rank": 8,
                                         "confidence_head": True})).eval().requires_grad_(False)
    drafter.load_state_dict(v1.state_dict(), strict=False)
    torch.manual_seed(5)
    torch.nn.init.normal_(drafter.confidence_head.proj.weight, std=0.5)
    # the rounds' cuts are the head's (draft_limits is held to the formula above)
    assert rounds_cut_by_p_min(target, drafter, 0.5) > 0
    with pytest.raises(ValueError, match="no confidence"):
        batched_speculative(target, v1, [[5, 9]], 8, draft_p_min=0.5)


def test_the_export_writes_llama_cpps_names_and_key(tmp_path):
    cfg = config(confidence_head=True)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in drafter_for(cfg).state_dict().items()}
    # conversion/qwen.py: has_conf = any("confidence_head.proj" in name); gguf-py maps
    # model.confidence_head.proj to conf_proj, ggml {n_embd + rank, 1} (and an optional bias {1})
    assert shapes["confidence_head.proj.weight"] == (1, 32 + 6) and shapes["confidence_head.proj.bias"] == (1,)
    written = export_config(cfg)
    assert written["dflash_config"]["confidence_head"] is True
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert draft_config_from_export(tmp_path) == cfg
    old = {**written, "dflash_config": {k: v for k, v in written["dflash_config"].items() if k != "confidence_head"}}
    (tmp_path / "config.json").write_text(json.dumps(old))  # an export made before the head existed
    assert not draft_config_from_export(tmp_path).confidence_head


@pytest.mark.parametrize("overrides, named", [
    (["draft.dspark.confidence_head=true"], "draft.dspark.confidence_head belongs to draft.family=dspark"),
    (["draft.family=dspark", "draft.dspark.confidence_head=true"], "objective.loss.confidence trains"),
    (["draft.family=dspark", "objective.loss={ce: 1, confidence: 1}"], "objective.loss.confidence trains"),
    (["objective.loss={ce: 1, confidence: 1}"], "objective.loss.confidence trains"),
])
def test_the_head_and_its_term_are_refused_in_one_line_apart(overrides, named):
    from dflash_train.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=re.escape(named)):
        build_config({}, overrides)
    build_config({}, ["draft.family=dspark", "draft.dspark.confidence_head=true", "objective.loss={ce: 1, confidence: 1}"])
