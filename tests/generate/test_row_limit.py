"""One huge input line must be a clear error naming file:line, found fast and in bounded memory
(a multi-megabyte line once grew `generate` to 24 GB)."""

from __future__ import annotations

import json
import time
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_train.cli import main
from dflash_train.data.formats import MAX_ROW_BYTES, DataError, iter_rows
from dflash_train.data.prompts import load_prompts
from tests.generate.conftest import write_jsonl

SMALL = {"messages": [{"role": "user", "content": "hi"}]}
HUGE = 20 << 20


def _huge_line_file(path):
    row = json.dumps({"messages": [{"role": "user", "content": "x" * HUGE}]}).encode()
    return write_jsonl(path, [SMALL, row, SMALL])


def test_huge_jsonl_line_is_an_error_naming_the_line_in_bounded_memory(tmp_path):
    path = _huge_line_file(tmp_path / "big.jsonl")
    started = time.monotonic()
    tracemalloc.start()
    try:
        rows = list(iter_rows(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 5
    assert [w for w, _ in rows] == [f"{path}:1", f"{path}:2", f"{path}:3"]
    assert rows[0][1] == SMALL and rows[2][1] == SMALL, "the rows around it still read"
    err = rows[1][1]
    assert isinstance(err, DataError) and str(err).startswith(f"{path}:2: row is longer than")
    assert "4 MB limit" in str(err)
    assert peak < 2 * MAX_ROW_BYTES + (4 << 20), f"peak Python memory {peak >> 20} MB for a 20 MB line"


def test_huge_parquet_row_is_an_error_naming_the_row(tmp_path):
    messages = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "a"}, {"role": "assistant",
                                                                                       "content": "y" * (5 << 20)}]]
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "messages": messages}), path)
    rows = list(iter_rows(path))
    assert rows[0][1]["messages"] == messages[0]
    assert isinstance(rows[1][1], DataError) and str(rows[1][1]).startswith(f"{path}:row 2: row is 52428")


def test_generate_cli_stops_on_a_huge_line_with_one_line_exit_2(tmp_path, tiny_target, capsys):
    path = _huge_line_file(tmp_path / "big.jsonl")
    started = time.monotonic()
    code = main(["generate", "--input", str(path), "--out", str(tmp_path / "out"), "--backend", "local",
                 "--model", str(tiny_target), "--max-tokens", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - started < 30
    assert f"error: {path}:2: row is longer than {MAX_ROW_BYTES} bytes" in err
    assert "Traceback" not in err


def test_prompt_file_with_a_huge_line_is_an_error(tmp_path):
    path = _huge_line_file(tmp_path / "prompts.jsonl")
    with pytest.raises(DataError, match=rf"{path}:2: row is longer"):
        load_prompts(str(path))
