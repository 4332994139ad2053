"""Bad input rows, input formats and the generate config."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_train.config import ConfigError
from dflash_train.data.formats import DataError
from dflash_train.generate.job import generate
from dflash_train.generate.shards import committed_shards
from dflash_train.generate.config import (
    build_generate_config,
    load_generate_config,
)
from tests.generate.conftest import read_rows, run, write_jsonl


def config_from_command_line(*argv: str):
    """The config `dflash-train generate ARGV` runs with: the CLI's own parser and loader."""
    from dflash_train.cli import build_parser
    from dflash_train.config_flags import with_flag_overrides

    args = with_flag_overrides(build_parser().parse_args(["generate", *argv]))
    return load_generate_config(args.config, args.overrides)

GOOD = {"messages": [{"role": "user", "content": "hi"}]}
BAD_LINES = [
    GOOD,                                                                   # line 1
    "{not json",                                                            # line 2
    {"messages": [{"role": "wizard", "content": "?"}]},                     # line 3
    {"messages": []},                                                       # line 4
    b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',              # line 5: latin-1 byte
    {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},  # line 6
    {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]},    # line 7
    GOOD,                                                                   # line 8
]


def test_a_bad_row_stops_the_run_naming_file_and_line(tmp_path, start_server):
    server = start_server("--echo")
    inputs = write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    with pytest.raises(DataError, match=rf"{inputs}:2: not valid JSON"):
        run(tmp_path, [inputs], [server.url], shard_size=1)
    # Rows finished before the bad one are committed, so a rerun after the fix keeps them.
    assert [r["source"] for r in read_rows(tmp_path / "out")] == [f"{inputs}:1"]


def test_skip_invalid_records_every_bad_row_with_its_reason(tmp_path, start_server):
    server = start_server("--echo")
    inputs = write_jsonl(tmp_path / "bad.jsonl", BAD_LINES)
    summary = run(tmp_path, [inputs], [server.url], skip_invalid=True)
    assert (summary["rows_in"], summary["ok"], summary["error"], summary["skipped"]) == (8, 2, 0, 6)
    reasons = {int(r["source"].rsplit(":", 1)[1]): r["reason"] for r in read_rows(tmp_path / "out")}
    assert reasons[1] is None and reasons[8] is None
    assert reasons[2].startswith("not valid JSON")
    assert "unknown role 'wizard'" in reasons[3]
    assert "empty or not a list" in reasons[4]
    assert reasons[5].startswith("not valid UTF-8")
    assert reasons[6] == "no user turn to answer"
    assert reasons[7] == "the first non-system turn is 'assistant', not 'user'"
    assert sum(summary["top_reasons"].values()) == 6


def test_skip_invalid_with_no_valid_row_fails_as_prepare_does(tmp_path, start_server, capsys):
    """The malformed rows are recorded (a rerun does not read them again), and the run exits 2."""
    from dflash_train.cli import main

    server = start_server("--echo")
    inputs = write_jsonl(tmp_path / "bad.jsonl", BAD_LINES[1:7])
    argv = ["generate", "--input", str(inputs), "--out", str(tmp_path / "out"), "--skip-invalid", "--no-progress",
            "http.server_urls=[" + server.url + "]"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {inputs}: no usable input row: all 6 skipped as malformed (each row's reason is in "
                   f"{tmp_path / 'out'}); nothing was generated")
    assert len(read_rows(tmp_path / "out")) == 6


def test_parquet_sharegpt_input_and_jsonl_output(tmp_path, start_server):
    server = start_server("--echo")
    table = pa.Table.from_pylist(
        [{"id": f"p{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
         for i in range(5)]
    )
    pq.write_table(table, tmp_path / "in.parquet")
    summary = run(tmp_path, [tmp_path / "in.parquet"], [server.url], output_format="jsonl", shard_size=2)
    assert summary["ok"] == 5 and summary["shards"] == 3
    rows = [json.loads(line) for p in sorted((tmp_path / "out").glob("shard-*.jsonl")) for line in p.open()]
    assert sorted(r["id"] for r in rows) == [f"p{i}" for i in range(5)]
    assert all(r["source"].endswith(f"in.parquet:row {int(r['id'][1:]) + 1}") for r in rows)


def test_config_from_yaml_with_cli_overrides(tmp_path):
    path = tmp_path / "gen.yaml"
    path.write_text(
        "inputs: [a.jsonl]\noutput_dir: out\nhttp:\n  server_urls: [http://h1:30000/v1]\n"
        "sampling:\n  temperature: 0.6\n  thinking: true\n"
    )
    cfg = config_from_command_line("-c", str(path), "--output", "elsewhere", "--server-url", "http://h2:30000",
                                   "--server-url", "http://h3:30000", "--max-tokens", "512", "sampling.seed=3",
                                   "--no-thinking", "--system-prompt", "a: b")
    assert cfg.inputs == ["a.jsonl"] and cfg.output_dir == "elsewhere"
    assert cfg.http.server_urls == ["http://h2:30000", "http://h3:30000"]
    assert (cfg.sampling.temperature, cfg.sampling.max_tokens, cfg.sampling.top_p, cfg.sampling.thinking) == (
        0.6, 512, 1.0, False)
    assert cfg.sampling.seed == 3 and cfg.sampling.system_prompt == "a: b"  # a string flag is not read as YAML
    cfg = config_from_command_line("-c", str(path), "--sampling.temperature", "0", "--http.server_urls", "http://h4")
    assert cfg.sampling.temperature == 0 and cfg.http.server_urls == ["http://h4"]
    cfg = build_generate_config({"inputs": ["a"], "output_dir": "o", "backend": "local"}, {"sampling.seed": 7})
    assert cfg.sampling.seed == 7 and cfg.model is None


@pytest.mark.parametrize(
    "tree, message",
    [
        ({"inputs": ["a"], "output_dir": "o", "temprature": 1}, "temprature: unknown key"),
        ({"inputs": ["a"], "output_dir": "o"}, "needs at least one server URL"),
        ({"inputs": ["a", "./a"], "output_dir": "o", "backend": "local"}, "lists a file twice"),
        ({"inputs": ["a"], "output_dir": "o", "backend": "local", "sampling": {"top_p": 0}}, "sampling.top_p"),
        ({"inputs": ["a"], "output_dir": "o", "backend": "local", "local": {"compile_step": True}},
         "compile_step compiles the graphed engine's step: it needs backend 'local' and local.engine 'graphed'"),
        ({"inputs": ["a"], "output_dir": "o", "backend": "local", "local": {"prefill": "padded"}},
         "prefill chooses the graphed engine's prefills: it needs backend 'local' and local.engine 'graphed'"),
        ({"inputs": ["a"], "output_dir": "o", "backend": "local", "local": {"engine": "graphed", "prefill": "ragged"}},
         "local.prefill"),
    ],
)
def test_config_errors_name_the_problem(tree, message):
    with pytest.raises(ConfigError, match=message):
        build_generate_config(tree)


def test_compile_step_reaches_the_graphed_engine(tiny_target):
    """`--compile-step` is read: the backend that `generate` loads from the config carries it to the
    engine it builds (no silent key); off unless asked."""
    from dflash_train.generate.local_backend import LocalBackend

    for flag in ([], ["--compile-step"]):
        cfg = config_from_command_line("--input", "a", "--output", "o", "--backend", "local", "--engine", "graphed",
                                       "--device", "cpu", *flag)
        assert LocalBackend.load(str(tiny_target), cfg.local).compile_step is bool(flag)


def test_the_prefill_choice_reaches_the_graphed_engine(tiny_target):
    """`--prefill` is read: the engine the backend builds to answer prefills as asked; auto unless asked."""
    import asyncio

    from dflash_train.decode.sampling import GenParams
    from dflash_train.generate.local_backend import LocalBackend

    for flag, packed in (([], True), (["--prefill", "padded"], False), (["--prefill", "packed"], True)):
        cfg = config_from_command_line("--input", "a", "--output", "o", "--backend", "local", "--engine", "graphed",
                                       "--device", "cpu", *flag)
        backend = LocalBackend.load(str(tiny_target), cfg.local)

        async def answer():
            try:
                return await backend.complete([{"role": "user", "content": "hi"}],
                                              GenParams(temperature=0.0, top_p=1.0, max_tokens=2))
            finally:
                await backend.aclose()
        asyncio.run(answer())
        assert backend._graphed.packed is packed


def test_a_prefill_the_model_cannot_take_is_refused_at_load_naming_the_key(tmp_path):
    """`--prefill packed` on a model flash attention cannot pack (head size 4) fails when the model
    loads, before any request, naming the key and the choices that work; auto loads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_train.generate.config import LocalConfig
    from dflash_train.generate.local_backend import LocalBackend
    from tests.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"local.prefill: packed prefills cannot run LlamaForCausalLM: head size 4 "
                                         r"\(flash attention: a multiple of 8 up to 256\) \(prefill auto or padded can\)"):
        LocalBackend.load(str(tmp_path), LocalConfig(device="cpu", engine="graphed", prefill="packed"))
    assert LocalBackend.load(str(tmp_path), LocalConfig(device="cpu", engine="graphed")).prefill == "auto"


def test_missing_input_file_is_an_error(tmp_path, start_server):
    server = start_server("--echo")
    cfg = build_generate_config(
        {"inputs": [str(tmp_path / "nope.jsonl")], "output_dir": str(tmp_path / "out"), "progress": False},
        {"http.server_urls": [server.url]},
    )
    with pytest.raises(DataError, match="data file not found"):
        generate(cfg)


def test_a_missing_later_input_stops_generate_before_any_answer(tmp_path, start_server):
    """Inputs are answered one file after another: the second one's absence is found before the first
    file's rows are answered, not after."""
    server = start_server("--echo")
    first = write_jsonl(tmp_path / "first.jsonl", [GOOD, GOOD])
    cfg = build_generate_config(
        {"inputs": [str(first), str(tmp_path / "second.jsonl")], "output_dir": str(tmp_path / "out"),
         "progress": False},
        {"http.server_urls": [server.url]},
    )
    with pytest.raises(DataError, match=f"data file not found: {tmp_path / 'second.jsonl'}$"):
        generate(cfg)
    assert committed_shards(tmp_path / "out", cfg.output_format) == []


def test_a_stop_on_a_bad_row_says_how_to_go_on(tmp_path, monkeypatch, capsys):
    """The same command would stop on the same row again: the message names the row to fix and the
    flag that skips such rows, and either way of going on then works."""
    import dflash_train.generate.job as job
    from dflash_train.cli import main
    from dflash_train.generate.backends import Completion

    class Echo:
        async def identity(self):
            return {"model": "echo"}

        async def complete(self, messages, params):
            return Completion(text="ok", prompt_tokens=1, completion_tokens=1, finish_reason="stop")

        async def aclose(self):
            pass

    monkeypatch.setattr(job, "make_backend", lambda cfg: Echo())
    inputs = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "{not json", GOOD])
    argv = ["generate", "--input", str(inputs), "--out", str(tmp_path / "out"), "--server-url", "http://x:1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "the same command resumes" not in err
    assert f"to go on, fix line 2 of {inputs} and run the same command again" in err
    assert f"  dflash-train {' '.join(argv)} --skip-invalid\n" in err
    assert err.strip().splitlines()[-1] == f"error: {inputs}:2: not valid JSON: Expecting property name enclosed " \
                                           "in double quotes (column 2)"
    assert main(argv + ["--skip-invalid"]) == 0
    # Rows are committed as they finish, not in input order: compare by key (file:line).
    statuses = {r["source"]: r["status"] for r in read_rows(tmp_path / "out")}
    assert statuses == {f"{inputs}:1": "ok", f"{inputs}:2": "skipped", f"{inputs}:3": "ok"}
