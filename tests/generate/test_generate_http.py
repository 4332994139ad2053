"""generate() against real OpenAI-compatible servers on 127.0.0.1 (echo responder, injected faults)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dflash_train.data.dataset import tokenize_files
from dflash_train.generate.job import generate
from dflash_train.generate.config import build_generate_config
from tests.generate.conftest import conversation, read_rows, run, write_jsonl
from tiny import tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from chat_server import echo_answer  # noqa: E402  the test server lives with the benchmarks


def test_every_assistant_turn_is_answered_in_order_from_the_targets_own_history(tmp_path, start_server):
    server = start_server("--echo")
    inputs = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"id": "openai", "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "first"}, {"role": "assistant", "content": "old one"},
                {"role": "user", "content": "second"}, {"role": "assistant", "content": "old two"},
                {"role": "user", "content": "third"}, {"role": "assistant", "content": "old three"},
            ]},
            {"conversations": [{"from": "human", "value": "sharegpt q1"}, {"from": "gpt", "value": "old"},
                               {"from": "human", "value": "sharegpt q2"}]},
            {"messages": [{"role": "user", "content": "just a prompt"}]},
        ],
    )
    summary = run(tmp_path, [inputs], [server.url], **{"sampling.system_prompt": "Default system."})
    assert (summary["rows_in"], summary["ok"], summary["error"], summary["skipped"]) == (3, 3, 0, 0)

    rows = {row["source"].rsplit(":", 1)[1]: row for row in read_rows(tmp_path / "out")}
    for row in rows.values():
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                # The echo answer hashes exactly what the request held: the target's own earlier answers.
                assert m["content"] == echo_answer(messages[:i])
        assert not any(m["content"].startswith("old") for m in messages)
        assert row["num_turns"] == sum(m["role"] == "assistant" for m in messages)
    assert [m["role"] for m in rows["1"]["messages"]] == ["system", "user", "assistant"] * 1 + ["user", "assistant"] * 2
    assert rows["1"]["messages"][0]["content"] == "Be brief."  # its own system prompt wins
    assert rows["1"]["id"] == "openai"
    assert [m["content"] for m in rows["2"]["messages"] if m["role"] == "user"] == ["sharegpt q1", "sharegpt q2"]
    assert rows["2"]["messages"][-1]["role"] == "assistant"  # ends with a user turn: one answer appended
    assert rows["3"]["messages"][0] == {"role": "system", "content": "Default system.", "reasoning_content": None}
    assert rows["3"]["messages"][-1]["role"] == "assistant"


def test_failures_drops_and_stalls_are_retried_and_nothing_is_lost(tmp_path, start_server):
    server = start_server("--echo", "--fail-every", "3", "--drop-every", "5", "--stall-every", "7", "--stall-s", "5")
    inputs = write_jsonl(tmp_path / "in.jsonl", [conversation(i, turns=2) for i in range(60)])
    summary = run(
        tmp_path, [inputs], [server.url], concurrency=8, shard_size=16,
        **{"http.request_timeout": 1.0, "http.backoff_s": 0.01, "http.max_retries": 20},  # slack for a loaded CI box
    )
    stats = server.stats()
    assert stats["failed"] > 10 and stats["dropped"] > 5 and stats["stalled"] > 5
    assert (summary["rows_in"], summary["ok"], summary["error"]) == (60, 60, 0)
    rows = read_rows(tmp_path / "out")
    assert sorted(r["id"] for r in rows) == sorted(f"c{i}" for i in range(60))
    assert all(r["status"] == "ok" and r["num_turns"] == 2 for r in rows)


def test_a_request_that_keeps_failing_becomes_a_counted_error_row(tmp_path, start_server):
    server = start_server("--echo", "--fail-marker", "BOOM")
    rows_in = [conversation(i) for i in range(10)]
    rows_in[4]["messages"][0]["content"] = "please BOOM"
    inputs = write_jsonl(tmp_path / "in.jsonl", rows_in)
    summary = run(tmp_path, [inputs], [server.url], **{"http.backoff_s": 0.001, "http.max_retries": 3})
    assert (summary["rows_in"], summary["ok"], summary["error"], summary["skipped"]) == (10, 9, 1, 0)
    (error,) = [r for r in read_rows(tmp_path / "out") if r["status"] != "ok"]
    assert error["id"] == "c4" and error["messages"] == []
    assert "turn 1: gave up after 4 attempts: HTTP 500" in error["reason"]
    assert server.stats()["failed"] == 4
    assert list(summary["top_reasons"].values()) == [1]

    # The training reader takes the output directory and trains on ok rows only.
    trained = tokenize_files([tmp_path / "out"], tiny_tokenizer(), 1024, skip_invalid=False)
    assert len(trained) == 9 and trained.stats.skipped == {"generation error": 1}


def test_load_spreads_over_servers_and_a_dead_one_costs_no_rows(tmp_path, start_server):
    a, b = start_server("--echo"), start_server("--echo")
    dead = start_server("--echo")
    dead.stop()  # its port now refuses connections
    inputs = write_jsonl(tmp_path / "in.jsonl", [conversation(i) for i in range(200)])
    summary = run(tmp_path, [inputs], [a.url, b.url], concurrency=16)
    assert summary["ok"] == 200
    assert min(a.stats()["requests"], b.stats()["requests"]) > 50

    # A server failing every request mid-run only costs retries: each retry goes to another server.
    broken = start_server("--echo", "--fail-every", "1")
    summary = run(tmp_path / "b", [inputs], [a.url, broken.url], **{"http.backoff_s": 0.001, "http.max_retries": 1})
    assert summary["ok"] == 200 and broken.stats()["failed"] > 20

    # Down at the start, it is reported: each server must say which model it serves before its
    # answers are trusted (two different targets behind one run would poison the data).
    out2 = tmp_path / "again"
    cfg = build_generate_config(
        {"inputs": [str(inputs)], "output_dir": str(out2), "progress": False, "model": "echo"},
        {"http.server_urls": [a.url, dead.url], "http.backoff_s": 0.001},
    )
    with pytest.raises(Exception, match="gave up"):
        generate(cfg)  # a server that is down at start is reported, not silently dropped
