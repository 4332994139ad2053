"""`--version` and `--help`: every flag of every command says what it does and shows its default."""

from __future__ import annotations

import argparse
from importlib.metadata import version

import pytest

from dflash_train.cli import build_parser, main
from dflash_train.config_flags import HelpFormatter


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _all_parsers() -> dict[str, argparse.ArgumentParser]:
    from dflash_train.distributed import launch

    parser = build_parser()
    parsers = {"dflash-train": parser, **_subparsers(parser)}
    # launch parses its own (torchrun-style) flags: capture its parser instead of parsing.
    captured = {}
    real_parse = argparse.ArgumentParser.parse_args

    def grab(self, argv=None, namespace=None):
        captured["launch"] = self
        return real_parse(self, ["-c", "x.yaml", "--colocated"])

    argparse.ArgumentParser.parse_args = grab
    try:
        launch.parse_args([])
    finally:
        argparse.ArgumentParser.parse_args = real_parse
    parsers["launch"] = captured["launch"]
    return parsers


def test_version_prints_name_and_installed_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"dflash-train {version('dflash-train')}"


def test_every_flag_of_every_command_has_help_and_shows_its_default():
    missing, hidden_defaults = [], []
    for name, parser in _all_parsers().items():
        assert issubclass(parser.formatter_class, HelpFormatter), f"{name}: defaults are not shown"
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(label)
            elif action.default not in (None, False, argparse.SUPPRESS) and str(action.default) not in text:
                hidden_defaults.append(label)
    assert not missing, f"flags without help: {missing}"
    assert not hidden_defaults, f"defaults not shown: {hidden_defaults}"


def test_prepare_example_override_is_a_data_setting():
    (overrides,) = [a for a in _subparsers(build_parser())["prepare"]._actions if a.dest == "overrides"]
    assert "data.train_files=" in overrides.help and "train.lr" not in overrides.help


def test_top_level_description_gives_the_order_of_commands():
    text = build_parser().format_help()
    order = [text.index(f"\n  {cmd} ") for cmd in ("prompts", "generate", "train", "eval", "export")]
    assert order == sorted(order) and "quickstart" in text


def test_eval_out_help_names_the_files_the_report_writes(tmp_path, monkeypatch):
    import dflash_train.eval.report as report

    monkeypatch.setattr(report, "plot_report", lambda rep, f: f.write(b""))  # no matplotlib needed
    written = [p.name for p in report.write_report({"tau": 1.0}, tmp_path)]
    help_text = " ".join(_subparsers(build_parser())["eval"].format_help().split())
    assert all(name in help_text for name in written), (written, help_text)


def test_quickstart_size_flags_state_the_device_defaults_and_reject_zero():
    import torch

    from dflash_train.quickstart import Sizes

    text = " ".join(_subparsers(build_parser())["quickstart"].format_help().split())
    for dev in ("cpu", "cuda"):
        sizes = Sizes.for_device(torch.device(dev))
        for field, flag in (("train_prompts", "--train-prompts"), ("eval_prompts", "--eval-prompts"),
                            ("answer_tokens", "--answer-tokens"), ("eval_new_tokens", "--eval-new-tokens")):
            assert flag in text and f"{getattr(sizes, field)} on {dev}" in text, (flag, dev)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quickstart", "--train-prompts", "0"])
