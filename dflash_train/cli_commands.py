"""The `dflash-train` commands' handlers: each reads its parsed arguments, runs a library function
and prints what it returns (tests call the library functions directly).

Each handler imports what it runs inside itself: torch, transformers and the rest stay off the
start-up path of `--help`, `doctor`, `prompts` and every command that does not need them.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from dflash_train.config import ConfigError, load_config
from dflash_train.disk import require_writable
from dflash_train.errors import UserError
from dflash_train.run_lock import RunLock
from dflash_train.train.stop_signals import EXIT_STATUS


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
    if args.source == "long" and not args.multi_turn:
        raise ValueError("--source long: its conversations grow the context turn after turn; without "
                         "--multi-turn only their first requests (under 2K tokens) would be written: add "
                         "--multi-turn 8 --max-chars 6000")
    source, exclude = prompt_source(args.source), turns_of(args.exclude)
    if args.multi_turn:
        chosen = multi_turn(source, args.multi_turn, args.max_chars, exclude)
    elif args.every_turn:
        chosen = every_turn(source, exclude)
    else:
        chosen = (Prompt(id=p.id, turns=p.turns[:1], system=p.system) for p in source)
    prompts = first_turns(chosen, args.num, args.max_chars, exclude)
    train, heldout = split_prompt_files(prompts, args.out, args.heldout)
    print(json.dumps({"train": train and str(train), "train_prompts": len(prompts) - args.heldout,
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
                                  draft_lengths=args.draft_lengths, draft_p_min=args.draft_p_min,
                                  backend_sampling=args.backend_sampling, our_speed=args.our_speed)
    summary = serve_check(llama, settings)
    print(format_summary(summary))
    print(f"report: {args.out}/serve_check.json")
    return 0 if summary["passed"] else 1


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
