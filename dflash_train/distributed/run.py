"""Disaggregated training on torch.distributed: target ranks feed drafter ranks.

    torchrun --nproc-per-node 3 -m dflash_train.distributed.run -c run.yaml --target-ranks 2
    torchrun --nproc-per-node 2 -m dflash_train.distributed.run -c run.yaml --colocated

One process per GPU (gloo on CPU). Roles and message protocol: layout.py and roles.py.
Faults: torchrun kills the whole group when one worker exits non-zero; across nodes (and for a
hung rank) every rank runs a heartbeat watchdog over the rendezvous TCPStore and exits non-zero
naming the rank that stopped. Checkpoints are written atomically by each group's rank 0 and hold
the GLOBAL data cursor, so a crashed run resumes with the same or another split.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dflash_train.config import RunConfig, load_config
from dflash_train.data.dataset import load_training_data
from dflash_train.targets.model import compile_decoder, load_target, resolve_device, warm_up_compiled
from dflash_train.checkpoint import local as ckpt
from dflash_train.checkpoint.storage import newest_common_intact, newest_common_step
from dflash_train.run_lock import RunLock
from dflash_train.distributed.layout import Layout, build_layout, drafter_runs
from dflash_train.distributed.options import add_rank_options
from dflash_train.train.shapes import bucket_shapes, stream_layer_ids
from dflash_train.train.stop_signals import EXIT_STATUS, StopSignals
from dflash_train.distributed.roles import (Link, TargetFeeder, agree_on_start, check_lead_rank_evals,
                                            check_single_process_keys, run_drafter)

log = logging.getLogger("dflash_train")

COLLECTIVE_TIMEOUT = timedelta(minutes=15)
"""Backstop only (a first flex_attention compile can take minutes); the watchdog is the fast path."""


def check_wall_clock_stops(runs: list[tuple[str, RunConfig]], world_size: int) -> None:
    """A time budget or deadline ends only the logging rank's loop early; the other ranks would wait
    in its collectives forever. Refused until every rank agrees on when to stop."""
    for name, run_cfg in runs:
        for key in ("time_budget_minutes", "deadline_minutes"):
            if world_size > 1 and getattr(run_cfg.train, key) is not None:
                raise ValueError(f"train.{key} (drafter {name}): not supported by `launch` on {world_size} ranks "
                                 "yet (only one rank would stop); use train.max_steps, or `train` on one GPU")


class Watchdog:
    """Every rank bumps a counter in the store each `interval` s and watches everyone else's: a rank
    whose counter stops for `timeout` s (dead, hung, or its node gone) or that reports a failure
    makes this rank exit non-zero with a message naming it, instead of hanging in a collective."""

    def __init__(self, store, rank: int, layout: Layout, timeout: float, interval: float = 1.0,
                 on_failure=None, where: str | None = None):
        self.store, self.rank, self.layout, self.where = store, rank, layout, where
        self.timeout, self.interval = timeout, interval
        self.on_failure = on_failure or _exit_failed
        self._stop = threading.Event()
        self._leave_status: int | None = None
        self._thread = threading.Thread(target=self._run, name="dflash-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if self.where:  # read back by the others' messages: a dead node is named, not only its ranks
            self.store.set(f"where/{self.rank}", self.where)
        self.store.add(f"beat/{self.rank}", 1)
        self._thread.start()
        return self

    def finish(self, failure: str | None = None) -> None:
        self.store.set(f"state/{self.rank}", f"failed: {failure}" if failure else "done")
        self._stop.set()

    def leave_after_drafters(self, status: int) -> None:
        """Exit with `status` once every drafter rank has finished (a target rank after a stop signal:
        it feeds until the drafters have saved, then nothing will consume what it sends)."""
        self._leave_status = status

    def silent_ranks(self, seconds: float) -> list[int]:
        """Ranks whose heartbeat does not move for `seconds`: after a failed send or collective, the
        peer that died is named here instead of only the transport's "connection closed"."""
        others = [r for r in range(self.layout.world_size) if r != self.rank]
        before = {r: self.store.add(f"beat/{r}", 0) for r in others}
        time.sleep(seconds)
        return [r for r in others if self.store.add(f"beat/{r}", 0) == before[r]
                and not self.store.check([f"state/{r}"])]

    def describe(self, rank: int) -> str:
        where = self.store.get(f"where/{rank}").decode() if self.store.check([f"where/{rank}"]) else None
        return f"rank {rank} ({self.layout.describe(rank)}{f', {where}' if where else ''})"

    def _run(self) -> None:
        others = [r for r in range(self.layout.world_size) if r != self.rank]
        seen = {r: (-1, time.monotonic()) for r in others}
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                if self._leave_status is not None and all(
                        self.store.check([f"state/{r}"]) for r in others if self.layout.drafter_role(r) is not None):
                    log.info("rank %d: every drafter rank has stopped; the target rank stops too", self.rank)
                    os._exit(self._leave_status)
                for r in others:
                    if self.store.check([f"state/{r}"]):
                        state = self.store.get(f"state/{r}").decode()
                        if state.startswith("failed"):
                            return self.on_failure(f"{self.describe(r)} {state}")
                        continue
                    count, since = seen[r]
                    now_count = self.store.add(f"beat/{r}", 0)
                    if now_count != count:
                        seen[r] = (now_count, time.monotonic())
                    elif time.monotonic() - since > self.timeout:
                        return self.on_failure(f"{self.describe(r)} sent no heartbeat for {self.timeout:.0f} s "
                                               "(process died, hung, or its node is gone)")
            except Exception as err:  # the store lives with the launcher / rank 0: it went away
                if not self._stop.is_set():
                    return self.on_failure(f"lost the rendezvous store ({err}); the launcher or rank 0 died")


def _exit_failed(message: str) -> None:
    print(f"dflash-train: rank {dist.get_rank()}: exiting because {message}", file=sys.stderr, flush=True)
    os._exit(1)  # the main thread may be blocked inside a collective that would never return


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash_train.distributed.run", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", required=True)
    p.add_argument("overrides", nargs="*")
    split = p.add_mutually_exclusive_group(required=True)
    split.add_argument("--target-ranks", type=int, help="ranks 0..T-1 run the target; the rest the drafters")
    split.add_argument("--colocated", action="store_true", help="every rank runs target and drafter")
    p.add_argument("--drafter-ranks", help="ranks per drafter group, e.g. 2,1 (default: an even split)")
    add_rank_options(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides)
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = drafter_runs(cfg)
    layout = build_layout(world, [name for name, _ in runs], target_ranks=args.target_ranks,
                          drafter_ranks=args.drafter_ranks, colocated=args.colocated,
                          tensor_parallel=cfg.target.tensor_parallel)
    layout.check_grad_accum(cfg.train.grad_accum)
    check_wall_clock_stops(runs, world)
    for _, run_cfg in runs:  # every rank refuses alike, before any target loads
        check_lead_rank_evals(run_cfg, layout)
        check_single_process_keys(run_cfg)
    group = layout.drafter_role(rank)
    if group is not None and layout.group_ranks(group)[0] == rank:  # the rank that writes the group's run dir
        # Held for the whole process (`launch` holds it for its ranks, which this then takes again).
        RunLock(runs[group][1].run_dir, "launch").__enter__()
    if args.resume == "auto":  # as one process does: damaged newest checkpoints moved aside, by one rank
        if rank == 0:
            newest_common_intact([run_cfg.run_dir for _, run_cfg in runs])
        dist.barrier()
    groups = [dist.new_group(layout.group_ranks(g)) for g in range(len(runs))]  # every rank creates every group
    mesh = None
    if layout.tensor_parallel > 1:
        shards = [dist.new_group(layout.target_group_ranks(k)) for k in range(layout.num_target_groups)]
        if layout.is_target(rank):
            mesh = DeviceMesh.from_group(shards[rank // layout.tensor_parallel], device.type)
    store = dist.PrefixStore("dflash-watchdog/", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=COLLECTIVE_TIMEOUT))
    # torchrun's GROUP_RANK is this machine's --node-rank.
    where = f"node {os.environ.get('GROUP_RANK', 0)} ({socket.gethostname()})"
    watchdog = Watchdog(store, rank, layout, args.heartbeat_timeout, where=where).start()
    try:
        stopped = run_rank(args, cfg, runs, layout, groups, rank, device, mesh, watchdog)
    except Exception as err:
        silent = watchdog.silent_ranks(seconds=3 * watchdog.interval) if isinstance(err, RuntimeError) else []
        names = ", ".join(watchdog.describe(r) for r in silent)
        print(f"dflash-train: rank {rank} ({layout.describe(rank)}) failed: {type(err).__name__}: {err}"
              + (f"\n  silent peers (likely dead): {names}" if silent else ""), file=sys.stderr, flush=True)
        watchdog.finish(failure=f"{type(err).__name__}: {err}")
        raise
    if stopped is not None:  # saved by the lead rank; the target ranks leave once every drafter rank has
        watchdog.finish()
        return EXIT_STATUS[stopped]
    dist.barrier()  # the store may live in rank 0: nobody leaves while others still need it
    watchdog.finish()
    dist.destroy_process_group()
    return 0


def run_rank(args, cfg: RunConfig, runs, layout: Layout, groups, rank: int, device: torch.device, mesh,
             watchdog: Watchdog) -> str | None:
    """This rank's part of the run; the stop signal that ended it early, else None."""
    link = Link(rank, device, args.max_in_flight)
    group = layout.drafter_role(rank)
    # Drafter-only ranks need just the target's embedding and LM head: its layers never reach the GPU.
    target = load_target(cfg.target, device, mesh=mesh, decoder=layout.is_target(rank))
    if cfg.target.compile:
        compile_decoder(target)  # a drafter-only rank has no layers here: its target is only marked, for the manifest
    dataset = load_training_data(cfg.data, target.tokenizer, target.identity["tokenizer"])
    feeder = None
    if layout.is_target(rank):
        layer_ids = [stream_layer_ids(run_cfg, target) for _, run_cfg in runs]
        feeder = TargetFeeder(cfg, target, dataset, layout, link, rank, layer_ids)
    if group is None:  # a target rank only: it feeds every step of the stream the drafters agree on
        # As the drafters' warm-up does for theirs. Before the stream's start, which the drafters wait for
        # (their own warm-up comes after it): a cold start pays the two one after the other, and no
        # drafter step waits on a compiling target.
        if target.compiled_here and cfg.data.buckets:
            start, shapes = time.perf_counter(), bucket_shapes(cfg.data)
            warm_up_compiled(target, shapes, feeder.layer_ids)
            log.info("rank %d: the compiled target warmed up on %d bucket shapes in %.1f s", rank, len(shapes),
                     time.perf_counter() - start)
        step, total_steps = agree_on_start(layout, rank, feeder, None)
        # On SIGTERM or Ctrl-C it feeds on while the drafters finish their step and save, then leaves.
        with StopSignals(cfg.checkpoint.grace_seconds, second_ends=False,
                         on_signal=lambda name: watchdog.leave_after_drafters(EXIT_STATUS[name])):
            for _ in range(step, total_steps):
                feeder.feed_step()
        stopped = None
    else:
        run_cfg = runs[group][1]
        path = args.resume
        if args.resume == "auto":
            step = newest_common_step([c.run_dir for _, c in runs])
            path = step and ckpt.checkpoint_path(run_cfg.run_dir, step)
        elif args.resume and len(runs) > 1:
            raise ValueError("--resume PATH needs a single drafter; use --resume auto with several")
        stopped = run_drafter(run_cfg, target, dataset, layout=layout, link=link, rank=rank, group_index=group,
                              group=groups[group], feeder=feeder, resume=path or None)
    link.drain()
    return stopped


if __name__ == "__main__":
    sys.exit(main())
