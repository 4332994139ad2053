"""What `generate` prints: no transformers warning per greedy call, a progress total that counts
rows (not blank lines), and after a failure what the output keeps and how to resume."""

from __future__ import annotations

import shlex

from dflash_train.cli import main
from dflash_train.decode.sampling import GenParams
from dflash_train.generate.job import count_rows
from dflash_train.decode.greedy import _generation_config
from tests.generate.conftest import write_jsonl

PROMPT = {"messages": [{"role": "user", "content": "hi"}]}


def test_generation_configs_are_valid_for_transformers_greedy_and_sampled():
    # strict validation raises exactly where transformers would warn "generation flags are not valid"
    for temperature in (0.0, 0.7):
        params = GenParams(temperature=temperature, top_p=0.9, max_tokens=4, thinking=None, seed=0)
        gen = _generation_config(params, {1, 2}, 0)
        gen.validate(strict=True)
        assert gen.do_sample == (temperature > 0)
    assert gen.top_k == 0 and gen.top_p == 0.9 and gen.temperature == 0.7, "sampling keeps its settings, top_k off"


def test_progress_total_counts_rows_not_blank_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"a": 1}\n\n   \n{"a": 2}\r\n\n{"a": 3}')  # blank lines, CRLF, no final newline
    assert count_rows([str(path)]) == 3


def test_failed_generate_says_what_is_kept_and_how_to_resume(tmp_path, tiny_target, capsys):
    inputs = write_jsonl(tmp_path / "in.jsonl", [PROMPT, PROMPT, "{not json"])
    argv = ["generate", "--input", str(inputs), "--out", str(tmp_path / "out"), "--backend", "local",
            "--model", str(tiny_target), "--max-tokens", "2", "--device", "cpu", "--output-format", "jsonl"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {inputs}:3: not valid JSON" in err
    assert f"{tmp_path / 'out'} keeps 2 committed rows (2 ok, 0 error, 0 skipped) in 1 shard(s)" in err
    assert f"fix line 3 of {inputs}" in err  # the same command alone would stop on the same row
    assert f"  {shlex.join(['dflash-train', *argv, '--skip-invalid'])}" in err.splitlines()
