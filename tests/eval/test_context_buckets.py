"""Acceptance by context length: each round placed where its context ends, against rounds placed by hand,
and a real eval whose buckets add up to its tau; one conversation long enough to cross a bucket, and
one of the `long` set, which crosses them all to 4K-8K."""

from __future__ import annotations

from bisect import bisect_right

import pytest

from dflash_train.data.prompts import Prompt
from dflash_train.eval.config import DecodeSettings
from dflash_train.eval.context_buckets import EDGES, ContextTally, bucket_names
from dflash_train.eval.report import evaluate, format_table

from .tiny_models import tiny_drafter, tiny_target


def test_each_round_counts_where_its_context_ends():
    tally = ContextTally()
    tally.add(1000, [10, 20, 3])  # rounds start at 1000, 1010 (0-1K), 1030 (1K-2K)
    tally.add(5000, [4])  # 4K-8K
    tally.add(200_000, [1, 2])  # past the last edge
    assert tally.rows() == [{"context": "0-1K", "rounds": 2, "tau": 15.0},
                            {"context": "1K-2K", "rounds": 1, "tau": 3.0},
                            {"context": "4K-8K", "rounds": 1, "tau": 4.0},
                            {"context": "128K+", "rounds": 2, "tau": 1.5}]
    assert bucket_names()[:4] == ["0-1K", "1K-2K", "2K-4K", "4K-8K"]


@pytest.fixture(scope="module")
def chat_target(smollm2_tokenizer):
    return tiny_target(vocab_size=49152, tokenizer=smollm2_tokenizer)


def test_the_buckets_of_an_eval_add_up_to_its_tau(chat_target):
    """A question of ~1,000 tokens: its answer's rounds start on both sides of the 1K edge."""
    long = Prompt(id="long", turns=[" ".join(["word"] * 1010) + " What next?"])
    short = Prompt(id="short", turns=["Say hello."])
    drafter = tiny_drafter(chat_target, block_size=4)
    report = evaluate(chat_target, drafter, [long, short], DecodeSettings(max_new_tokens=40, speed_prompts=0))
    rows = report["tau_by_context"]
    assert [r["context"] for r in rows] == ["0-1K", "1K-2K"]
    assert sum(r["rounds"] for r in rows) == report["num_rounds"]
    assert sum(r["tau"] * r["rounds"] for r in rows) / report["num_rounds"] == pytest.approx(report["tau"])
    assert report["lossless"] == {"matches": 2, "total": 2}
    assert "tau, context 1K-2K tokens" in format_table(report)


@pytest.mark.slow(seconds=30)
def test_the_long_set_fills_every_bucket_to_4k_at_tiny_size(smollm2_tokenizer):
    """One conversation of the `long` set, asked turn after turn by a tiny target with SmolLM2's
    tokenizer (its answers the next turn's context): each turn's rounds land in the bucket of the
    context it starts at, the first request's under 2K and the last over 4K, all lossless."""
    from dflash_train.data.prompts import load_prompts

    target = tiny_target(vocab_size=49152, tokenizer=smollm2_tokenizer, max_positions=8192)
    conversation = load_prompts("long", 1)
    drafter = tiny_drafter(target, block_size=4)
    report = evaluate(target, drafter, conversation, DecodeSettings(max_new_tokens=12, speed_prompts=0))
    turns, rows = report["turns"], report["tau_by_context"]
    assert [t["turn"] for t in turns] == list(range(len(conversation[0].turns)))
    assert turns[0]["prompt_tokens"] < 2048 and turns[-1]["prompt_tokens"] > 4096
    starts = {bucket_names()[bisect_right(EDGES, t["prompt_tokens"])] for t in turns}
    assert {"2K-4K", "4K-8K"} <= starts <= {r["context"] for r in rows}
    assert sum(r["rounds"] for r in rows) == report["num_rounds"]
    assert sum(r["tau"] * r["rounds"] for r in rows) / report["num_rounds"] == pytest.approx(report["tau"])
    assert report["lossless"] == {"matches": len(turns), "total": len(turns)}
