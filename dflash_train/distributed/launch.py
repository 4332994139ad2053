"""`dflash-train launch`: pick the target/drafter split, then exec torchrun (nothing home-made).

    dflash-train launch -c run.yaml --target-gpus 2 --drafter-gpus 6
    dflash-train launch -c run.yaml --target-gpus auto          # measure, plan, print why, run
    dflash-train launch -c run.yaml --colocated --nproc-per-node 2
    dflash-train launch -c run.yaml --target-gpus 4 --nnodes 2 --node-rank 0 --rdzv-endpoint host:29500

torchrun runs with --max-restarts 0: when one worker dies the agent stops the others and reports
the failed rank; the workers' watchdog covers ranks on other nodes (distributed.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from dflash_train.config import COMMON_KEYS, RunConfig, load_config
from dflash_train.config_flags import HelpFormatter, add_config_flags, asks_help_all, with_flag_overrides
from dflash_train.distributed.layout import Plan, build_layout, drafter_runs, plan_split
from dflash_train.distributed.options import add_rank_options, rank_argv
from dflash_train.run_lock import RunLock, held_for_workers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflash-train launch", description=__doc__, formatter_class=HelpFormatter,
                                allow_abbrev=False)
    p.add_argument("-c", "--config", required=True, help="YAML run config")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
    split = p.add_mutually_exclusive_group(required=True)
    split.add_argument("--target-gpus", help="global ranks that run the target, or 'auto'")
    split.add_argument("--colocated", action="store_true", help="every GPU runs target and drafter")
    p.add_argument("--drafter-gpus", help="GPUs per drafter group, e.g. 6 or 4,2 (default: the rest, split evenly)")
    p.add_argument("--nproc-per-node", type=int, help="processes per node (default: visible GPUs)")
    p.add_argument("--nnodes", type=int, default=1, help="machines in the job")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index among --nnodes")
    p.add_argument("--rdzv-endpoint", help="host:port of the rendezvous (multi-node)")
    p.add_argument("--rdzv-id", default="dflash-train", help="job id, the same on every node")
    add_rank_options(p)
    p.add_argument("--measure-steps", type=int, default=3, help="timed steps per role for --target-gpus auto")
    p.add_argument("--gpu-memory-gib", type=float,
                   help="memory of one GPU for the plan's check (default: this node's first GPU; none on CPU)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the memory plan and the torchrun command instead of running it")
    show_all, argv = asks_help_all(list(sys.argv[1:] if argv is None else argv))
    add_config_flags(p, RunConfig, shown=None if show_all else COMMON_KEYS)  # as `train` takes them
    args = with_flag_overrides(p.parse_args(argv))
    # The workers' command line carries the flags as `key=value` overrides: text as typed, the rest as
    # JSON (which the loader reads as YAML).
    args.overrides = [o if isinstance(o, str) else f"{o[0]}={o[1] if isinstance(o[1], str) else json.dumps(o[1])}"
                      for o in args.overrides]
    return args


def torchrun_command(args: argparse.Namespace, split: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc_per_node),
           "--max-restarts", "0"]
    if args.nnodes == 1 and not args.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        if not args.rdzv_endpoint:
            raise ValueError("--nnodes > 1 needs --rdzv-endpoint host:port (the same on every node)")
        cmd += ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", args.rdzv_id]
    cmd += ["-m", "dflash_train.distributed.run", "-c", args.config, *split, *rank_argv(args)]
    return cmd + list(args.overrides)


def measure(config: str, overrides: list[str], steps: int) -> tuple[float, list[float], float | None]:
    """Per-GPU tokens/s of the target alone, each drafter alone, and both colocated, from the real
    step functions on this process's GPU: a full train_step (target + drafter) and target.features
    over the same micro-batches; drafter time = step time - target time. Needs both to fit."""
    # Imported here: a launch given its split loads no model and runs no step, and these
    # (transformers' model classes, the training step) took ~2.5 s of every node's start.
    from dflash_train.targets.model import synced_time
    from dflash_train.train.build import build
    from dflash_train.train.inputs import load_inputs
    from dflash_train.train.progress import Progress
    from dflash_train.train.step import TrainStep

    cfg = load_config(config, overrides)
    device, target, dataset = load_inputs(cfg)

    def timed(fn) -> float:
        t0 = synced_time(device)
        fn()
        return synced_time(device) - t0

    target_s, step_s, tokens = 0.0, [], 0
    for g, (_, run_cfg) in enumerate(drafter_runs(cfg)):
        parts = build(run_cfg, target, dataset)
        step, progress = TrainStep(run_cfg, parts), Progress(total_steps=parts.total_steps)
        step.prepare()  # every bucket shape compiled (train.compile, target.compile), as training does first
        step(progress)  # warm-up: the allocator (an unbucketed compiled run may still compile in the timed steps)
        start = progress.cursor
        step_s.append(sum(timed(lambda: step(progress)) for _ in range(steps)))
        if g == 0:
            progress.cursor = start  # the same micro-batches again, through the target alone
            for _ in range(steps * run_cfg.train.grad_accum):
                batch, _ = step.local.next_micro_batch(progress)
                tokens += batch["num_tokens"]
                target_s += timed(lambda b=batch: parts.features(b))
    drafter_tps = [tokens / max(s - target_s, 1e-9) for s in step_s]
    colocated = tokens / step_s[0] if len(step_s) == 1 else None  # colocated runs one drafter group
    return tokens / target_s, drafter_tps, colocated


def choose_split(args: argparse.Namespace) -> list[str]:
    """The split's arguments for distributed.py, checked here with the workers' own layout call so a
    split that cannot run is refused before torchrun starts."""
    cfg = load_config(args.config, args.overrides)
    world, tp = args.nproc_per_node * args.nnodes, cfg.target.tensor_parallel
    names = [name for name, _ in drafter_runs(cfg)]
    if args.colocated:
        build_layout(world, names, target_ranks=None, drafter_ranks=None, colocated=True, tensor_parallel=tp)
        return ["--colocated"]
    if args.target_gpus != "auto":
        build_layout(world, names, target_ranks=int(args.target_gpus), drafter_ranks=args.drafter_gpus,
                     colocated=False, tensor_parallel=tp)
        split = ["--target-ranks", args.target_gpus]
        return split + (["--drafter-ranks", args.drafter_gpus] if args.drafter_gpus else [])
    if args.nnodes > 1:
        raise ValueError("--target-gpus auto measures on this node's GPU: run it on one node, then pass the split")
    # A sharded target is measured whole on one GPU (it must fit) and its group assumed to scale
    # ideally, N x one GPU: an upper bound, said in the plan's reason.
    target_tps, drafter_tps, colocated_tps = measure(args.config, [*args.overrides, "target.tensor_parallel=1"],
                                                     args.measure_steps)
    plan: Plan = plan_split(world, target_tps * tp, drafter_tps, colocated_tps, tensor_parallel=tp)
    assumed = f" (target group throughput assumed {tp} x one unsharded GPU)" if tp > 1 else ""
    print(f"dflash-train launch: plan for {world} GPUs: {plan.reason}{assumed}", flush=True)
    if plan.colocated:
        return ["--colocated"]
    return ["--target-ranks", str(plan.num_targets), "--drafter-ranks", ",".join(map(str, plan.group_sizes))]


def check_memory(args: argparse.Namespace, colocated: bool) -> None:
    """Prints the per-GPU memory plan (memory.py) and refuses one that cannot fit."""
    import torch
    from transformers import AutoConfig

    from dflash_train.distributed.memory import GiB, check_fits, plan_memory
    from dflash_train.draft.model import target_layer_ids
    from dflash_train.targets.path import load_pretrained
    from dflash_train.targets.tokenizer import resolve_target_path

    cfg = load_config(args.config, args.overrides)
    hf = load_pretrained(AutoConfig, resolve_target_path(cfg.target.path))
    runs = drafter_runs(cfg)
    ids = {i for _, run_cfg in runs for i in target_layer_ids(run_cfg.draft, hf.num_hidden_layers)}
    if cfg.objective.needs_target_logits:
        ids.add(hf.num_hidden_layers - 1)
    dtype_bytes = 2 if cfg.target.dtype == "auto" else getattr(torch, cfg.target.dtype).itemsize
    roles = []
    for name, run_cfg in runs:
        *target, drafter = plan_memory(run_cfg, hf, num_features=len(ids), max_in_flight=args.max_in_flight,
                                       tensor_parallel=cfg.target.tensor_parallel, colocated=colocated,
                                       dtype_bytes=dtype_bytes)
        roles += target if not roles else []  # one target stream feeds every drafter group
        roles.append(replace(drafter, role=f"{drafter.role} '{name}'") if len(runs) > 1 else drafter)
    print("dflash-train launch: memory per GPU (estimate):\n  " + "\n  ".join(r.line() for r in roles), flush=True)
    gib = args.gpu_memory_gib or (torch.cuda.get_device_properties(0).total_memory / GiB
                                  if torch.cuda.is_available() else None)
    if gib:
        check_fits(roles, int(gib * GiB))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nproc_per_node is None:
        import torch

        args.nproc_per_node = torch.cuda.device_count() or None
    if not args.nproc_per_node:
        raise ValueError("no GPU visible: give --nproc-per-node (CPU runs use gloo, one process each)")
    split = choose_split(args)
    check_memory(args, colocated=split == ["--colocated"])
    cmd = torchrun_command(args, split)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    hold_run_dirs(args)
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)


def hold_run_dirs(args: argparse.Namespace) -> None:
    """Every drafter's run dir locked before torchrun starts, by the process torchrun becomes (the
    lock's descriptor survives the exec) and so for the whole job; the ranks are told it is held.
    Node 0 holds it for a job on several nodes, whose run dirs may be one shared folder."""
    dirs = [run_cfg.run_dir for _, run_cfg in drafter_runs(load_config(args.config, args.overrides))]
    if args.node_rank == 0:
        for run_dir in dirs:
            lock = RunLock(run_dir, "launch").__enter__()  # held until the job ends: never exited
            os.set_inheritable(lock.descriptor, True)
    os.environ.update(held_for_workers(dirs))
