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

    parser = build_parser(show_all=True)
    parsers = {"dflash-train": parser, **_subparsers(parser)}
    # launch parses its own (torchrun-style) flags: capture its parser instead of parsing.
    captured = {}
    real_parse = argparse.ArgumentParser.parse_args

    def grab(self, argv=None, namespace=None):
        captured["launch"] = self
        return real_parse(self, ["-c", "x.yaml", "--colocated"])

    argparse.ArgumentParser.parse_args = grab
    try:
        launch.parse_args(["--help-all"])
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


def test_a_flag_is_never_taken_for_a_longer_one(capsys):
    """Prefix matching is off in every parser: `--see 1` is not `--seed 1`, it fails and names it."""
    for argv, hint in ((["train", "-c", "run.yaml", "--see", "1"], "--see: did you mean --seed?"),
                       (["train", "-c", "run.yaml", "--train.log", "5"], "--train.log: did you mean --train.log_every?"),
                       (["eval", "--targ", "smollm2"], "--targ: did you mean --target")):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2 and hint in capsys.readouterr().err
    for name, parser in _all_parsers().items():
        assert parser.allow_abbrev is False, name


def test_launch_help_imports_no_torch_and_launch_takes_the_flags_train_takes(tmp_path):
    import subprocess
    import sys

    code = ("import sys\nfrom dflash_train.cli import main\ntry:\n    main(['launch', '--help'])\nexcept SystemExit:\n"
            "    pass\nassert 'torch' not in sys.modules, 'launch --help imported torch'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--train.lr" in done.stdout, done.stderr
    from dflash_train.distributed.launch import parse_args, torchrun_command

    args = parse_args(["-c", "run.yaml", "--colocated", "--nproc-per-node", "2", "--train.lr", "3e-4", "seed=5",
                       "--data.train_files", "a.jsonl", "--data.train_files", "b.jsonl", "--no-train.compile"])
    assert sorted(torchrun_command(args, ["--colocated"])[-4:]) == [
        'data.train_files=["a.jsonl", "b.jsonl"]', "seed=5", "train.compile=false", "train.lr=3e-4"]


def test_eval_help_says_the_target_is_required_without_a_run_config(tmp_path, capsys):
    text = " ".join(_subparsers(build_parser())["eval"].format_help().split())
    assert "(default: the run config's; required without -c)" in text and "(default: smollm2)" not in text
    assert main(["eval", "--drafter", str(tmp_path)]) == 2
    assert "eval needs --target" in capsys.readouterr().err


def test_help_lists_the_common_settings_and_help_all_every_one(capsys):
    from dflash_train.config import COMMON_KEYS, RunConfig
    from dflash_train.config_flags import config_fields, with_flag_overrides

    assert COMMON_KEYS <= {key for key, _ in config_fields(RunConfig)}
    for argv in (["train", "--help"], ["launch", "--help"], ["train", "--help-all"], ["launch", "--help-all"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = capsys.readouterr().out
        assert "--train.lr" in text and "--data.train_files" in text and "--run_dir" in text
        if argv[1] == "--help":
            assert "--objective.gamma" not in text and "more settings, set less often: --help-all lists" in text
            assert len(text.splitlines()) < 180
        else:
            assert "--objective.gamma" in text and "--help-all lists" not in text
    args = with_flag_overrides(build_parser().parse_args(["train", "-c", "x.yaml", "--objective.gamma", "5"]))
    assert args.overrides == [("objective.gamma", 5)]  # a setting --help leaves out is a flag all the same


def test_every_command_names_its_output_out(tmp_path, capsys):
    """One name for where a command writes: --out (generate's older --output and export's older
    positional are still read)."""
    commands = _subparsers(build_parser(show_all=True))
    for name in ("generate", "export", "prepare", "capture", "prompts", "corpus", "curve", "eval", "serve-check"):
        assert "--out" in {o for a in commands[name]._actions for o in a.option_strings}, name
    assert main(["export", str(tmp_path / "nothing")]) == 2
    assert "export needs its output directory once: --out DIR" in capsys.readouterr().err
