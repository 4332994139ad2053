"""serve-check against the real llama.cpp: SmolLM2 and a drafter export, converted by llama.cpp's own
converter and served by llama-server. CI builds llama.cpp before the tests (.ci/run), so there these
tests run; elsewhere they say how to get it."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from dflash_train.config_model import TargetConfig
from dflash_train.data.prompts import load_prompts
from dflash_train.decode.spec_decode import target_greedy
from dflash_train.draft.dflash2 import DFlash2DraftModel
from dflash_train.draft.dspark import DSparkDraftModel
from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig
from dflash_train.eval.export import draft_config_from_export, export_config
from dflash_train.eval.report import encode, stop_token_ids
from dflash_train.targets.model import load_target
from dflash_train.serve.check import ServeCheckSettings, counted_as_engine, format_summary, serve_check
from dflash_train.serve.llama_cpp import LlamaCppError, find_llama_cpp
from dflash_train.serve.llama_server import ServerError
from draft.helpers_draft import randomize_selector


def test_counted_as_engine_stops_drafting_before_the_budget():
    # no proposal accepted: 32 tokens = the prefill's + 30 verified steps + one plain decode (llama.cpp
    # counted 30 steps for each such answer)
    assert counted_as_engine([1] * 31, [9] * 32, set(), 32, 8) == (30, 0)
    # a round accepting 7 with 5 tokens left: llama.cpp drafts 4 and accepts them, then decodes the last
    assert counted_as_engine([1, 1, 8, 1], [9] * 8, set(), 8, 8) == (3, 4)


def test_counted_as_engine_accepts_no_draft_past_a_stop_token():
    # the prefill's 5, then a round whose proposals 6, EOS, 7 all match: llama.cpp takes 6, and the EOS
    # from the target
    assert counted_as_engine([4], [5, 6, 2], {2}, 100, 8) == (1, 1)
    # an EOS as the round's last draft is accepted
    assert counted_as_engine([3], [5, 6, 2], {2}, 4, 8) == (1, 2)


@pytest.fixture(scope="module")
def llama():
    try:
        return find_llama_cpp()
    except LlamaCppError as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI builds llama.cpp before the tests: {err}")
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def smollm2_export(tmp_path_factory):
    """A random-init drafter for SmolLM2 in the export format (what `export` writes)."""
    torch.manual_seed(0)
    cfg = DraftModelConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                           intermediate_size=256, num_hidden_layers=1, vocab_size=49152, block_size=4,
                           target_layer_ids=[1, 20], num_target_layers=30, mask_token_id=16, rms_norm_eps=1e-5,
                           rope_theta=100000.0, max_position_embeddings=8192)
    out = tmp_path_factory.mktemp("export")
    (out / "config.json").write_text(json.dumps(export_config(cfg, mask_token="<jupyter_start>")))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in DFlashDraftModel(cfg).state_dict().items()},
              out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("serve")


def settings(drafter, out, **kw) -> ServeCheckSettings:
    return ServeCheckSettings(target="smollm2", drafter=str(drafter), out=out, num_prompts=2, max_new_tokens=12,
                              threads=1, **kw)


@pytest.mark.slow(seconds=110)
def test_llama_cpp_serves_the_export_as_our_decoder_counts_it(llama, smollm2_export, work):
    summary = serve_check(llama, settings(smollm2_export, work, draft_lengths=(1,)))
    print(format_summary(summary))
    assert summary["passed"], format_summary(summary)
    assert summary["lossless"] == {"matches": 2, "total": 2, "near_ties": 0}
    assert summary["same_answer_as_ours"] == {"matches": 2, "total": 2}
    # the engine's own counters equal our rounds counted by its budget rule, prompt by prompt
    assert summary["same_steps_and_accepted"] == {"matches": 2, "total": 2}
    assert summary["engine_verification_steps"] == summary["our_steps_counted_as_engine"] > 0
    assert json.loads((work / "serve_check.json").read_text())["passed"]
    # a row per draft length, the block's full one (3) always among them and the one compared with ours
    rows = {row["draft_length"]: row for row in summary["draft_lengths"]}
    assert sorted(rows) == [1, 3]
    assert all(row["lossless"] == {"matches": 2, "total": 2, "near_ties": 0} for row in rows.values())
    assert rows[3]["verification_steps"] == summary["engine_verification_steps"]
    assert rows[1]["drafted"] <= rows[1]["verification_steps"]  # one draft a step at most
    # llama.cpp's own clock of its drafter: a part of each round's time, at every length
    assert all(0 < row["drafting_ms"] < row["round_ms"] for row in rows.values())
    assert summary["best_draft_length"] in summary["draft_lengths"] and summary["device"] == "cpu"
    # beside the engine's: our static decoder on the same prompts, fp32 on the CPU, its answers the target's
    ours = summary["our_static_decoder"]
    assert ours["device"] == "cpu" and ours["dtype"] == "float32" and ours["answers_differ"] == 0
    assert ours["speedup"] > 0 and ours["tau"] >= 1
    assert "static decoder, same prompts" in format_summary(summary)


@pytest.mark.slow(seconds=40)
def test_an_export_without_target_layer_ids_fails_in_one_line(llama, smollm2_export, work, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(smollm2_export, broken)
    config = json.loads((broken / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (broken / "config.json").write_text(json.dumps(config))
    # our side decodes the intact export; llama.cpp is handed the broken one
    with pytest.raises(ServerError, match="target_layers") as err:
        serve_check(llama, settings(smollm2_export, work, export=str(broken)))
    assert "\n" not in str(err.value)


def chain_drafter(smollm2_export, confidence_head: bool = False) -> tuple[DraftModelConfig, DSparkDraftModel, int]:
    """A DSpark drafter that drafts by its Markov chain alone: a zero final norm makes every backbone
    logit 0, and the head holds the target's own greedy bigrams on the test's prompts (a previous
    token's code picks the token that followed it). Its drafts are right only where the engine
    follows the same chain, slot after slot, so no acceptance at all would show a head left out.
    Also returns the number of bigrams (code dimensions in use)."""
    target = load_target(TargetConfig(path="smollm2", dtype="float32"), torch.device("cpu"))
    bigrams: dict[int, int] = {}
    for prompt in load_prompts("mt-bench", 2):
        ids = encode(target, prompt.messages([]))
        answer = target_greedy(target, ids, 12, stop_token_ids(target)).tokens
        seq = [int(ids[0, -1]), *answer]
        for prev, nxt in zip(seq, seq[1:]):
            bigrams.setdefault(prev, nxt)
    cfg = dataclasses.replace(draft_config_from_export(smollm2_export), family="dspark", markov_rank=64,
                              confidence_head=confidence_head)
    model = DSparkDraftModel(cfg)
    with torch.no_grad():
        model.norm.weight.zero_()
        head = model.markov_head
        head.markov_w1.weight.zero_()
        for i, (prev, nxt) in enumerate(bigrams.items()):
            head.markov_w1.weight[prev, i] = 1.0
            head.markov_w2.weight[nxt, i] = 8.0
    return cfg, model, len(bigrams)


def save_export(cfg: DraftModelConfig, model: DFlashDraftModel, out):
    (out / "config.json").write_text(json.dumps(export_config(cfg, mask_token="<jupyter_start>")))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def dspark_export(smollm2_export, tmp_path_factory):
    cfg, model, _ = chain_drafter(smollm2_export)
    return save_export(cfg, model, tmp_path_factory.mktemp("dspark"))


@pytest.fixture(scope="module")
def dspark_confidence_export(smollm2_export, tmp_path_factory):
    """The chain drafter with a confidence head that reads the previous token's code alone (the hidden
    state is 0): sure after every other bigram's first token (sigmoid(3)), unsure after the others
    (sigmoid(-3)), one half after a token of no bigram. A threshold of 0.3 then cuts drafts at
    places the chain decides, the first slot's included (an empty draft: a plain target step)."""
    cfg, model, num_bigrams = chain_drafter(smollm2_export, confidence_head=True)
    with torch.no_grad():
        proj = model.confidence_head.proj
        proj.weight.zero_()
        proj.bias.zero_()
        for i in range(num_bigrams):
            proj.weight[0, cfg.hidden_size + i] = 3.0 if i % 2 == 0 else -3.0
    return save_export(cfg, model, tmp_path_factory.mktemp("dspark_confidence"))


@pytest.mark.slow(seconds=90)
def test_llama_cpp_drafts_the_dspark_chain_round_for_round(llama, dspark_export, work):
    summary = serve_check(llama, settings(dspark_export, work, our_speed=False))
    print(format_summary(summary))
    assert summary["passed"], format_summary(summary)
    assert "our_static_decoder" not in summary  # --no-our-speed
    assert summary["same_steps_and_accepted"] == {"matches": 2, "total": 2}
    assert summary["engine_accepted"] > 0  # the chain's drafts, accepted on both sides


@pytest.mark.slow(seconds=90)
def test_llama_cpp_cuts_dspark_drafts_at_the_confidence_threshold_as_we_do(llama, dspark_confidence_export, work):
    summary = serve_check(llama, settings(dspark_confidence_export, work, draft_p_min=0.3))
    print(format_summary(summary))
    assert summary["passed"], format_summary(summary)
    assert summary["same_steps_and_accepted"] == {"matches": 2, "total": 2}
    assert summary["engine_accepted"] > 0
    assert summary["engine_drafted"] < 3 * summary["engine_verification_steps"]  # some drafts were cut
    assert "whole blocks" in summary["our_static_decoder"]["error"]  # the static decoder cuts no draft


@pytest.fixture(scope="module")
def dflash2_export(smollm2_export, tmp_path_factory):
    """A random-init DFlash2 drafter for SmolLM2 whose selector is random too, so its confidence along the
    walk (the softmax of the chosen candidate's scores) spreads over (1/k, 1) and a threshold cuts some
    drafts, the first slot's included."""
    base = draft_config_from_export(smollm2_export)
    cfg = DraftModelConfig(**{**vars(base), "family": "dflash2", "conv_kernel_size": 2, "conv_group_size": 16,
                              "selector_rank": 8, "selector_top_k": 4})
    torch.manual_seed(0)
    model = DFlash2DraftModel(cfg)
    randomize_selector(model, std=0.3)
    return save_export(cfg, model, tmp_path_factory.mktemp("dflash2"))


@pytest.mark.slow(seconds=90)
def test_llama_cpp_cuts_dflash2_drafts_where_the_selector_is_unsure_as_we_do(llama, dflash2_export, work):
    summary = serve_check(llama, settings(dflash2_export, work, draft_p_min=0.5, our_speed=False))
    print(format_summary(summary))
    assert summary["passed"], format_summary(summary)
    assert summary["same_steps_and_accepted"] == {"matches": 2, "total": 2}
    assert 0 < summary["engine_drafted"] < 3 * summary["engine_verification_steps"]  # some drafts were cut


def test_counted_as_engine_counts_a_round_cut_to_no_draft_as_no_step():
    # rounds drafting 3, 0 (a plain target step) and 1 proposals: two verification steps
    assert counted_as_engine([3, 1, 2], [9] * 20, set(), 20, 4, drafted=[3, 0, 1]) == (2, 3)
