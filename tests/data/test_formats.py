"""Conversation files: errors name file:line; skip_invalid accounts for every row; formats agree.
Rows are read as `tokenize_files` reads them: unparsed (iter_unparsed_rows), then read_row each."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_train.data.dataset import tokenize_files
from dflash_train.data.formats import BLANK, Conversation, DataError, expand_paths, iter_rows, iter_unparsed_rows, read_row
from tiny import tiny_tokenizer

GOOD_OPENAI = {
    "id": "c1",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": [{"type": "text", "text": "4"}]},
    ],
}
GOOD_SHAREGPT = {
    "id": "c1",
    "conversations": [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "2+2?"},
        {"from": "gpt", "value": "4"},
    ],
}
EXPECTED = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def write_lines(path, lines: list) -> str:
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else (json.dumps(line) if not isinstance(line, str) else line).encode())
            f.write(b"\n")
    return str(path)


def read(paths) -> list[Conversation | DataError | str]:
    return [read_row(where, row) for path in expand_paths(paths) for where, row in iter_unparsed_rows(path)]


def test_sharegpt_and_openai_give_the_same_messages(tmp_path):
    a = read(write_lines(tmp_path / "a.jsonl", [GOOD_OPENAI]))
    b = read(write_lines(tmp_path / "b.jsonl", [GOOD_SHAREGPT]))
    assert a[0].messages == b[0].messages == EXPECTED
    assert a[0].id == b[0].id == "c1"
    assert a[0].source.endswith("a.jsonl:1")


BAD_ROWS = [
    ("not json", "{\"messages\": [", "not valid JSON"),
    ("unknown role", {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown role 'robot'"),
    ("empty conversation", {"messages": []}, "empty"),
    ("non utf-8", b"{\"messages\": \"\xff\xfe\"}", "UTF-8"),
    ("missing field", {"prompt": "hello"}, "no 'messages', 'conversations' or 'text'"),
    ("missing content", {"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]}, "content must be a string"),
    ("no assistant", {"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
]


@pytest.mark.parametrize("name,row,message", BAD_ROWS, ids=[r[0] for r in BAD_ROWS])
def test_bad_row_error_names_file_and_line(tmp_path, name, row, message):
    path = write_lines(tmp_path / "d.jsonl", [GOOD_OPENAI, "", GOOD_SHAREGPT, row, GOOD_OPENAI])
    rows = read(path)  # the blank line is no row, but it is counted where rows are
    assert [type(r) for r in rows] == [Conversation, str, Conversation, DataError, Conversation] and rows[1] == BLANK
    assert f"{path}:4" in str(rows[3])
    assert message in str(rows[3])
    with pytest.raises(DataError, match=f"{path}:4"):
        tokenize_files([path], tiny_tokenizer(), 256, skip_invalid=False)


def test_blank_lines_are_counted_in_the_training_data_and_never_reach_generate(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [GOOD_OPENAI, "", "   ", GOOD_SHAREGPT])
    got = tokenize_files([path], tiny_tokenizer(), 256, skip_invalid=False)
    assert got.stats.to_dict() == {"rows": 4, "ok": 2, "skipped": {BLANK: 2}}
    assert [where for where, _ in iter_rows(path)] == [f"{path}:1", f"{path}:4"]


def test_skip_invalid_counts_every_row(tmp_path):
    rows = [GOOD_OPENAI] + [r[1] for r in BAD_ROWS] + [GOOD_SHAREGPT, GOOD_OPENAI]
    path = write_lines(tmp_path / "d.jsonl", rows)
    got = tokenize_files([path], tiny_tokenizer(), 256, skip_invalid=True)
    stats = got.stats
    assert len(got) == stats.ok == 3
    assert sum(stats.skipped.values()) == len(BAD_ROWS)
    assert stats.total == len(rows)
    assert stats.to_dict()["rows"] == len(rows)
    assert len(stats.skipped) >= 5, f"reasons should be told apart: {dict(stats.skipped)}"


def test_parquet_input(tmp_path):
    path = tmp_path / "d.parquet"
    rows = [{"id": "c1", "messages": EXPECTED}, {"id": "c2", "messages": EXPECTED}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    got = read(path)
    assert [c.id for c in got] == ["c1", "c2"]
    assert got[0].messages == EXPECTED
    assert got[1].source == f"{path}:row 2"
    sharegpt = tmp_path / "s.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD_SHAREGPT]), sharegpt)
    assert read(sharegpt)[0].messages == EXPECTED


def test_unsupported_format_and_missing_file(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported"):
        read(tmp_path / "d.csv")
    with pytest.raises(DataError, match="not found"):
        read(tmp_path / "nope.jsonl")


def test_text_rows_are_a_corpus_and_an_empty_one_is_named(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"id": "t1", "text": "some plain text"}) + "\n" + json.dumps({"text": " "}) + "\n")
    row, empty = read([path])
    assert (row.id, row.text, row.messages) == ("t1", "some plain text", [])
    assert isinstance(empty, DataError)
    stats = tokenize_files([path], tiny_tokenizer(), 256, skip_invalid=True).stats
    assert stats.to_dict() == {"rows": 2, "ok": 1, "skipped": {"field 'text' must be a non-empty string": 1}}
    with pytest.raises(DataError, match=r"corpus.jsonl:2: field 'text'"):
        tokenize_files([path], tiny_tokenizer(), 256, skip_invalid=False)


def test_a_line_cut_short_is_reported_as_such_not_at_column_1(tmp_path):
    """json reports the end of a cut line as "line 2 column 1" (the newline read): the message says
    where the line ends instead. An error inside the line keeps its own column."""
    whole = json.dumps(GOOD_OPENAI)
    path = write_lines(tmp_path / "d.jsonl", [whole[:30], whole[:-1] + "\r", whole[:13], '{"messages": x}'])
    errors = [str(row) for _, row in iter_rows(path)]
    assert errors[0] == f"{path}:1: not valid JSON: the line ends at column 30 before its JSON value does (cut short?)"
    assert errors[1].startswith(f"{path}:2: not valid JSON: the line ends at column {len(whole) - 1} before")
    assert "ends at column 13" in errors[2]  # cut between two members (line 1: inside a string)
    assert errors[3] == f"{path}:4: not valid JSON: Expecting value (column 14)"
