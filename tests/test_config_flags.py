"""Command-line flags derived from config fields, and the one loader every command reads."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from dflash_train.config_flags import HelpFormatter, add_config_flags, config_fields, with_flag_overrides
from dflash_train.config_loader import ConfigError, Section, build, load

REPO = Path(__file__).resolve().parent.parent


class Inner(Section):
    """What the inner section is for."""

    rate: float = Field(0.5, gt=0)
    """How fast, in units per step."""
    names: list[str] = Field(default_factory=list)
    """One name per use of the flag."""
    shape: dict[str, int] = Field(default_factory=dict)
    """Read as YAML."""
    fast: bool = False
    """Go fast."""


class Job(Section):
    out: str = Field("o", json_schema_extra={"flag": "--output"})
    """Where it goes."""
    mode: Literal["a", "b"] = "a"
    """Which way: a or b."""
    count: int | None = Field(None, ge=1)
    """How many; default: all."""
    inner: Inner = Field(default_factory=Inner)


def parser_for(model, short: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("overrides", nargs="*")
    add_config_flags(p, model, short=short)
    return p


def settings(model, argv: list[str], short: bool = True, tree: dict | None = None):
    args = with_flag_overrides(parser_for(model, short).parse_args(argv))
    return build(model, tree, args.overrides)


def test_each_field_is_a_flag_with_its_docstring_and_default():
    text = " ".join(parser_for(Job, short=True).format_help().split())
    assert "--rate RATE, --inner.rate RATE How fast, in units per step. (default: 0.5)" in text
    assert "--output OUTPUT Where it goes. (default: o)" in text
    assert "--mode {a,b} Which way: a or b. (default: a)" in text
    assert "inner (config section): What the inner section is for." in text
    assert "How many; default: all." in text and "(default: None)" not in text
    long_only = " ".join(parser_for(Job, short=False).format_help().split())
    assert "--inner.rate RATE How fast" in long_only and "--rate" not in long_only and "--output" not in long_only


def test_a_field_added_to_a_section_becomes_a_flag():
    class Wider(Inner):
        depth: int = 3
        """How deep it goes."""

    class WiderJob(Job):
        inner: Wider = Field(default_factory=Wider)

    assert ("inner.depth", "How deep it goes.") in [(k, f.description) for k, f in config_fields(WiderJob)]
    assert "--inner.depth DEPTH How deep it goes. (default: 3)" in " ".join(
        parser_for(WiderJob, short=False).format_help().split())
    assert settings(WiderJob, ["--depth", "7"]).inner.depth == 7


def test_flag_values_are_read_by_the_field_type():
    cfg = settings(Job, ["--output", "a: b", "--mode", "b", "--count", "3", "--names", "x", "--inner.names", "y",
                         "--shape", "{h: 2}", "--fast", "--rate", "2e-1"])
    assert (cfg.out, cfg.mode, cfg.count) == ("a: b", "b", 3)  # a string flag is kept as typed, not read as YAML
    assert cfg.inner.names == ["x", "y"] and cfg.inner.shape == {"h": 2} and cfg.inner.fast is True
    assert cfg.inner.rate == pytest.approx(0.2)
    assert settings(Job, ["--no-fast"], tree={"inner": {"fast": True}}).inner.fast is False
    with pytest.raises(SystemExit):  # a choice outside the Literal is refused by the parser
        parser_for(Job, short=True).parse_args(["--mode", "c"])


def test_flags_override_the_file_and_the_dotted_overrides():
    assert settings(Job, ["inner.rate=0.25"], tree={"inner": {"rate": 0.1}}).inner.rate == 0.25
    assert settings(Job, ["inner.rate=0.25", "--rate", "4"], tree={"inner": {"rate": 0.1}}).inner.rate == 4
    assert settings(Job, [], tree={"inner": {"rate": 0.1}, "mode": "b"}).mode == "b"  # flags not given keep the file's


def test_an_unknown_or_bad_key_is_rejected_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"inner\.rat: unknown key"):
        settings(Job, ["inner.rat=1"])
    with pytest.raises(ConfigError, match=r"inner\.rate: Input should be greater than 0"):
        settings(Job, ["--rate", "-1"])
    path = tmp_path / "job.yaml"
    path.write_text("inner:\n  colour: red\n")
    with pytest.raises(ConfigError, match=rf"invalid config \({path}\):\n  inner\.colour: unknown key"):
        load(Job, path)
    with pytest.raises(ConfigError, match="'mode' is not a section"):
        settings(Job, ["mode.x=1"], tree={"mode": "a"})


def test_two_fields_claiming_one_short_flag_fail_when_the_parser_is_built():
    class Clash(Section):
        a: Inner = Field(default_factory=Inner)
        b: Inner = Field(default_factory=Inner)

    parser_for(Clash, short=False)  # the dotted keys differ
    with pytest.raises(argparse.ArgumentError, match="conflicting option string"):
        parser_for(Clash, short=True)


def test_every_setting_of_every_command_has_a_description_and_shows_its_default():
    from dflash_train.cli import build_parser
    from dflash_train.config import RunConfig
    from dflash_train.eval.config import EvalJobConfig
    from dflash_train.generate.config import GenerateConfig

    commands = {name: p for a in build_parser(show_all=True)._actions if isinstance(a, argparse._SubParsersAction)
                for name, p in a.choices.items()}
    for command, model in (("train", RunConfig), ("prepare", RunConfig), ("capture", RunConfig),
                           ("generate", GenerateConfig), ("eval", EvalJobConfig)):
        text = " ".join(commands[command].format_help().split())
        for key, field in config_fields(model):
            assert field.description, f"{command}: {key} has no docstring"
            default = field.get_default(call_default_factory=True)
            assert f"--{key}" in text or command in ("generate", "eval"), (command, key)
            if (command, key) == ("eval", "target.path"):  # eval's target: the run config's, or given
                assert "(default: the run config's; required without -c)" in text
            elif default is not None and repr(default) != "PydanticUndefined":
                assert f"(default: {default})" in text, (command, key)


def test_the_cli_loads_run_configs_through_the_flags_too(tmp_path):
    from dflash_train.cli import build_parser

    args = with_flag_overrides(build_parser().parse_args(
        ["train", "-c", "x.yaml", "train.lr=1e-3", "--train.lr", "2e-3", "--train.compile", "--data.train_files", "a",
         "--data.train_files", "b", "--objective.loss", "{ce: 0.5, kl: 0.5}", "--resume", "auto"]))
    from dflash_train.config import build_config

    cfg = build_config({}, args.overrides)
    assert cfg.train.lr == pytest.approx(2e-3) and cfg.train.compile is True and cfg.data.train_files == ["a", "b"]
    assert cfg.objective.loss == {"ce": 0.5, "kl": 0.5} and args.resume == "auto"


def test_launch_does_not_import_the_cli():
    """One-way dependencies: the CLI imports launch's entry point, never the other way round."""
    code = "import sys, dflash_train.distributed.launch; assert 'dflash_train.cli' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]


def test_eval_runs_the_job_its_flags_describe(tmp_path, monkeypatch, capsys):
    import dflash_train.eval.report as report
    from dflash_train.cli import main

    jobs = []
    monkeypatch.setattr(report, "run_eval", lambda job: jobs.append(job) or [{}] * len(job.prompts))
    monkeypatch.setattr(report, "format_table", lambda rep: "table")
    out = tmp_path / "eval"
    assert main(["eval", "--target", "smollm2", "--drafter", "d", "--max-new-tokens", "9", "--out", str(out)]) == 0
    (job,) = jobs
    assert (job.target.path, job.drafter, job.decode.max_new_tokens, job.out) == ("smollm2", "d", 9, str(out))
    assert job.prompts == ["mt-bench"]
    assert capsys.readouterr().out == f"table\nreport: {out}/eval.json, chart: {out}/eval.png\n"
    # several sets: one job, a report directory per label
    assert main(["eval", "--target", "smollm2", "--drafter", "d", "--prompts", "humaneval", "--prompts",
                 "held=h.jsonl", "--out", str(out)]) == 0
    assert jobs[1].prompts == ["humaneval", "held=h.jsonl"]
    assert capsys.readouterr().out == "".join(f"table\nreport: {out / label}/eval.json, chart: {out / label}/eval.png\n"
                                              for label in ("humaneval", "held"))
