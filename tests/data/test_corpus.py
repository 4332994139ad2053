"""Conversation corpus: segments cut at user turns within the size limit; held-out prompts never leak."""

from __future__ import annotations

import json

from dflash_train.cli import main
from dflash_train.data.corpus import build_corpus, segments


def chat(*texts):
    roles = ["user", "assistant"] * len(texts)
    return [{"role": r, "content": t} for r, t in zip(roles, texts)]


def test_segments_start_at_user_turns_and_respect_the_limit():
    messages = chat("q1", "a" * 10, "q2", "b" * 10, "q3", "c" * 40, "q4", "d" * 5)
    segs, too_long = segments(messages, max_chars=30)
    assert too_long == 1  # q3 + 40 characters cannot fit any segment
    assert [[m["content"] for m in s] for s in segs] == [["q1", "a" * 10, "q2", "b" * 10], ["q4", "d" * 5]]
    assert all(s[0]["role"] == "user" and sum(len(m["content"]) for m in s) <= 30 for s in segs)


def test_a_conversation_asking_a_heldout_prompt_is_dropped_whole():
    convs = [("c1", chat("Hello there", "hi")),
             ("c2", chat("first", "x", "  WHAT is   2+2? ", "4")),  # held-out prompt, other case/spacing
             ("c3", chat("what is 2+2", "four"))]  # a different prompt (no '?'): kept
    rows, stats = build_corpus(convs, ["What is 2+2?"], max_chars=100)
    assert [r["id"] for r in rows] == ["c1#0", "c3#0"]
    assert stats.dropped_heldout == 1 and stats.segments == 2


def test_corpus_command_on_the_real_sharegpt_package(tmp_path):
    heldout = tmp_path / "heldout_prompts.jsonl"
    main(["prompts", "--source", "sharegpt", "--num", "6", "--heldout", "3", "--max-chars", "400",
          "--out", str(tmp_path)])
    out = tmp_path / "corpus.jsonl"
    assert main(["corpus", "--exclude", str(heldout), "--max-total-chars", "200000", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    held = {json.loads(line)["messages"][0]["content"] for line in heldout.read_text().splitlines()}
    assert rows and all(m["content"] not in held for r in rows for m in r["messages"])
    assert all(r["messages"][0]["role"] == "user" and r["messages"][-1]["role"] == "assistant" for r in rows)
