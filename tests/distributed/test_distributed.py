"""Disaggregated training on CPU/gloo: several processes must reproduce the single-process Trainer.

Equivalence runs fork workers from this process (fast: torch is already imported); the fault test
goes through torchrun, whose group-kill on a dead worker is part of what is tested.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torch._dynamo.utils import counters

from dflash_train.distributed import run as run_module
from dflash_train.distributed.roles import TargetFeeder
from dflash_train.checkpoint.storage import newest_common_step
from dflash_train.distributed.run import Watchdog
from dflash_train.distributed.launch import main as launch_main
from dflash_train.distributed.layout import Layout, plan_split
from dist_runs import children, dist_env, losses, read_metrics, reference_losses, spawn, torchrun, write_assets, write_config
from tiny import tiny_target


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return write_assets(tmp_path_factory.mktemp("assets"), tiny_target(num_layers=3, hidden=32))


@pytest.mark.parametrize("world,split,objective", [
    (3, ["--target-ranks", "2"], {}), (2, ["--colocated"], {}),
    (3, ["--target-ranks", "1"], {"feature_noise": 0.5}),  # each micro-batch's noise from its seed, on any rank
    # D-PACE's weights come from each rank's own probabilities; the step's denominator is still known ahead
    (3, ["--target-ranks", "1"], {"slot_weights": "dpace", "gamma": 7.0}),
], ids=["2targets+1drafter", "colocated-2", "1target+2drafters-noise", "1target+2drafters-dpace"])
def test_matches_single_process(assets, tmp_path, world, split, objective):
    extra = {"objective": {"block_size": 4, "num_anchors": 8, "gamma": 4.0, **objective}} if objective else {}
    config = write_config(assets, tmp_path / "run", **extra)
    assert spawn(world, ["-c", str(config), *split]) == [0] * world
    expected = reference_losses(config, tmp_path / "ref")
    assert len(expected) == 4
    assert losses(tmp_path / "run") == pytest.approx(expected, abs=1e-5)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]


def test_bucketed_split_counts_the_real_tokens(assets, tmp_path):
    """Length buckets pad a batch with empty rows, which attend to one pad token: the drafter rank
    counts what the target rank collated, not the attention mask (that counted one token per empty
    row, through a host read of a device tensor)."""
    data = {"train_files": [str(assets / "data.jsonl")], "max_length": 96, "token_budget": 192,
            "max_batch_size": 2, "length_bucket": 32}
    config = write_config(assets, tmp_path / "run", data=data)
    assert spawn(3, ["-c", str(config), "--target-ranks", "2"]) == [0] * 3
    assert losses(tmp_path / "run") == pytest.approx(reference_losses(config, tmp_path / "ref"), abs=1e-5)
    tokens = [r["tokens"] for r in read_metrics(tmp_path / "run")]
    assert tokens == [r["tokens"] for r in read_metrics(tmp_path / "ref")] and len(tokens) == 4


@pytest.mark.slow(seconds=60)
def test_a_split_launch_with_a_compiled_target(assets, tmp_path, monkeypatch):
    """`target.compile` in a split layout: the target rank warms its compiled layers up on every bucket
    shape before the stream starts (as the drafters' warm-up does in one process) and compiles
    nothing while it feeds; the losses are the single-process run's, and the manifest the drafter
    rank writes says the target was compiled, though that rank holds none of its layers."""
    graphs = tmp_path / "graphs.txt"  # the target rank's count of compiled graphs, after the warm-up and each step

    def note(when):
        with open(graphs, "a") as f:
            f.write(f"{when} {counters['stats']['unique_graphs']}\n")

    warm_up, feed_step = run_module.warm_up_compiled, TargetFeeder.feed_step
    monkeypatch.setattr(run_module, "warm_up_compiled", lambda *a: (warm_up(*a), note("warm")))  # forked: inherited
    monkeypatch.setattr(TargetFeeder, "feed_step", lambda self: (feed_step(self), note("step")))
    torch._dynamo.reset()
    counters.clear()  # forked ranks inherit this process's counts
    data = {"train_files": [str(assets / "data.jsonl")], "max_length": 96, "token_budget": 192,
            "max_batch_size": 4, "length_bucket": 32}  # 4, 3 and 2 rows
    config = write_config(assets, tmp_path / "run", data=data, target={"path": str(assets / "target"),
                                                                       "dtype": "float32", "compile": True})
    # A forked rank inherits inductor's compile-worker pool without the threads that serve it, and
    # waits on it forever (torchrun's ranks are fresh processes): the forked ranks compile in process.
    with torch._inductor.config.patch(compile_threads=1):
        assert spawn(2, ["-c", str(config), "--target-ranks", "1"]) == [0] * 2
    notes = [line.split() for line in graphs.read_text().splitlines()]
    assert [when for when, _ in notes] == ["warm"] + ["step"] * 4
    assert {int(count) for _, count in notes} == {3}  # static, then symbolic in rows and length, and one row
    assert losses(tmp_path / "run") == pytest.approx(reference_losses(config, tmp_path / "ref"), abs=1e-5)
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["target"]["compiled"] is True


def test_two_drafters_from_one_stream(assets, tmp_path):
    """1 target feeds a 2-rank data-parallel group (block 4) and a 1-rank group (block 8, 2 layers,
    distilled from the target's logits: its stream carries the final hidden states, the other's not)."""
    drafters = [{"name": "b4"}, {"name": "b8", "draft": {"num_layers": 2},
                                 "objective": {"block_size": 8, "gamma": 7.0, "loss": {"ce": 0.5, "kl": 0.5}}}]
    config = write_config(assets, tmp_path / "run", drafters=drafters)
    assert spawn(4, ["-c", str(config), "--target-ranks", "1", "--drafter-ranks", "2,1"]) == [0] * 4
    reference_losses(config, tmp_path / "ref")
    assert len(losses(tmp_path / "ref" / "b8")) == 4
    for name in ("b4", "b8"):
        assert losses(tmp_path / "run" / name) == pytest.approx(losses(tmp_path / "ref" / name), abs=1e-5), name


def _eval_prompts(tmp_path: Path) -> Path:
    prompts = tmp_path / "heldout_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("alpha beta", "draft a token")))
    return prompts


def test_colocated_periodic_eval_runs_on_the_lead_rank(assets, tmp_path):
    """eval.every through launch: the colocated group's lead rank holds the whole target and
    writes <run_dir>/eval.jsonl at every eval step; training itself is unchanged."""
    config = write_config(assets, tmp_path / "run")
    evals = ["eval.every=2", f"eval.prompts={_eval_prompts(tmp_path)}", "eval.num_prompts=2", "eval.max_new_tokens=6"]
    assert spawn(2, ["-c", str(config), "--colocated", *evals]) == [0, 0]
    records = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]  # one writer: no step twice
    for r in records:
        assert 1.0 <= r["tau"] <= 4 and r["num_rounds"] > 0
        assert r["lossless"]["matches"] == r["lossless"]["total"] == 2
    assert losses(tmp_path / "run") == pytest.approx(reference_losses(config, tmp_path / "ref"), abs=1e-5)


@pytest.mark.parametrize("key", ["eval.every=2", "eval.heldout_files=[x.jsonl]"])
def test_split_layout_refuses_lead_rank_evals(assets, tmp_path, capfd, key):
    """Drafter ranks of a split layout hold only the target's embedding and LM head: every rank
    refuses the key by name before loading anything, instead of ignoring it."""
    config = write_config(assets, tmp_path / "run")
    argv = ["-c", str(config), "--target-ranks", "1", key, f"eval.prompts={_eval_prompts(tmp_path)}"]
    assert 0 not in spawn(2, argv)
    name = key.split("=")[0]
    assert f"{name} needs the whole target on the drafter's lead rank: use --colocated" in capfd.readouterr().err
    assert not (tmp_path / "run").exists()


def test_launch_refuses_the_single_process_feature_cache(assets, tmp_path, capfd):
    """data.cache_features works in `dflash-train train`; a launch must not silently drop it."""
    config = write_config(assets, tmp_path / "run")
    assert 0 not in spawn(2, ["-c", str(config), "--colocated", "data.cache_features=true"])
    assert "data.cache_features keeps the features in the memory of the one process" in capfd.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow(seconds=30)
def test_killed_rank_stops_everyone_then_resume_with_another_split(assets, tmp_path):
    config = write_config(assets, tmp_path / "run")
    steps = ["train.max_steps=60", "train.grad_accum=2"]
    proc = torchrun(3, ["-c", str(config), "--target-ranks", "2", *steps])
    first = tmp_path / "run" / "checkpoints" / "step_00000002"
    deadline = time.monotonic() + 90
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.exists() and proc.poll() is None, "the run never reached its first checkpoint"
    os.kill(children(proc.pid)[1], signal.SIGKILL)  # target rank 1
    killed_at = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    assert time.monotonic() - killed_at < 60
    assert proc.returncode != 0
    # Named either by torchrun's root cause or by the survivor whose send failed first.
    assert (re.search(r"Root Cause.*rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: -9", out, re.S)
            or "silent peers (likely dead): rank 1 (target 1, node 0 (" in out), out[-3000:]
    assert not children(proc.pid)
    saved = newest_common_step([str(tmp_path / "run")])
    assert saved is not None and saved < 60
    # The same run resumed as 1 target + 2 drafter ranks ends exactly where an uninterrupted one does.
    resumed = ["-c", str(config), "--target-ranks", "1", "--resume", "auto", *steps, "checkpoint.every=1000"]
    assert spawn(3, resumed) == [0] * 3
    expected = reference_losses(config, tmp_path / "ref", [*steps, "checkpoint.every=1000"])
    assert losses(tmp_path / "run") == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow(seconds=20)
def test_resume_auto_falls_back_past_a_damaged_newest_checkpoint(assets, tmp_path):
    """As one process does: the newest checkpoint cut short is moved aside and the ranks resume from
    the one before it, ending where an uninterrupted run does."""
    config = write_config(assets, tmp_path / "run")  # 4 steps, saved at 2 and 4
    split = ["-c", str(config), "--target-ranks", "1"]
    assert spawn(3, split) == [0] * 3
    model = tmp_path / "run" / "checkpoints" / "step_00000004" / "model.safetensors"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    assert spawn(3, [*split, "--resume", "auto"]) == [0] * 3
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["step_00000002", "step_00000004", "step_00000004.corrupt"]
    assert losses(tmp_path / "run") == pytest.approx(reference_losses(config, tmp_path / "ref"), abs=1e-5)


@pytest.mark.slow(seconds=40)
def test_sigterm_to_launch_saves_the_step_and_the_resumed_run_matches(assets, tmp_path):
    """A scheduler's SIGTERM to `launch` (torchrun passes it to every rank): the two replicas of the
    drafter group stop after the same step, the lead saves it, the target rank leaves once they have,
    and `--resume auto` ends where an uninterrupted run does."""
    steps = ["train.max_steps=60", "train.grad_accum=2", "checkpoint.every=1000"]
    config = write_config(assets, tmp_path / "run")
    cmd = [sys.executable, "-m", "dflash_train", "launch", "-c", str(config), "--nproc-per-node", "3",
           "--target-gpus", "1", *steps]
    proc = subprocess.Popen(cmd, env=dist_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    at = random.randint(2, 20)
    deadline = time.monotonic() + 120
    while len(losses(tmp_path / "run")) < at and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=90)
    saved = newest_common_step([str(tmp_path / "run")])
    assert saved is not None and at <= saved < 60, out[-3000:]
    assert "SIGTERM: stopping at step" in out and "every drafter rank has stopped; the target rank stops too" in out
    assert len(losses(tmp_path / "run")) == saved
    assert spawn(3, ["-c", str(config), "--target-ranks", "1", "--resume", "auto", *steps]) == [0] * 3
    expected = reference_losses(config, tmp_path / "ref", steps)
    assert losses(tmp_path / "run") == pytest.approx(expected, abs=1e-5)


def test_watchdog_names_a_silent_rank_and_a_failed_one():
    store = torch.distributed.HashStore()
    layout = Layout(1, (2,), ("b16",))
    failures = []
    dog = Watchdog(store, 0, layout, timeout=0.3, interval=0.05, on_failure=failures.append).start()
    store.add("beat/1", 1)
    store.set("state/1", "done")  # a finished rank is never reported
    time.sleep(0.6)
    dog.finish()
    assert failures == ["rank 2 (drafter 1 of group 'b16') sent no heartbeat for 0 s (process died, hung, or its node is gone)"]
    failures.clear()
    store.set("state/1", "failed: ValueError: bad")
    Watchdog(store, 0, layout, timeout=30, interval=0.05, on_failure=failures.append).start()
    time.sleep(0.3)
    assert failures == ["rank 1 (drafter 0 of group 'b16') failed: ValueError: bad"]


def test_layout_balances_micro_batches():
    layout = Layout(2, (3, 1), ("a", "b"))
    assert layout.world_size == 6 and layout.group_ranks(1) == [5]
    assert [layout.target_of(m) for m in range(4)] == [0, 1, 0, 1]
    assert [layout.consumers(m) for m in range(4)] == [[2, 5], [3, 5], [4, 5], [2, 5]]
    assert layout.consumed_by(3, 0, 4) == [1]
    with pytest.raises(ValueError, match="grad_accum"):
        layout.check_grad_accum(2)
    colocated = Layout(2, (2,), ("d",), colocated=True)
    assert colocated.consumers(3) == [1] and colocated.describe(1) == "target 1 + drafter 1 of group 'd'"


def test_plan_split_picks_the_fastest_pipeline():
    # docs/design.md#reference-figures, the H200 numbers: target 32K tokens/s, drafter 21.4K, both on one GPU 12.8K.
    plan = plan_split(8, 32_000, [21_400], 12_800)
    assert plan.colocated and plan.tokens_per_s == pytest.approx(8 * 12_800)
    assert "vs 3 target + 5 drafter GPUs" in plan.reason
    plan = plan_split(8, 32_000, [21_400], None)  # both do not fit on one GPU
    assert (plan.num_targets, plan.group_sizes, plan.colocated) == (3, (5,), False)
    assert plan.tokens_per_s == pytest.approx(96_000) and "target-bound" in plan.reason
    plan = plan_split(8, 100_000, [20_000], 10_000)
    assert (plan.num_targets, plan.group_sizes) == (2, (6,)) and "drafter-bound" in plan.reason
    plan = plan_split(6, 30_000, [30_000, 15_000], None)  # the slower drafter gets more GPUs
    assert plan.tokens_per_s == 30_000 and plan.group_sizes[1] > plan.group_sizes[0]


@pytest.mark.slow(seconds=40)
def test_launch_measures_compiled_steps_after_every_graph_is_made(assets, tmp_path, monkeypatch):
    """--target-gpus auto times steps of a bucketed, compiled run: every bucket shape is compiled
    before the clock starts (one warm-up step covered one shape, and the timed steps compiled the rest)."""
    from dflash_train.distributed.launch import measure
    from dflash_train.targets import model
    seen = []
    clock = model.synced_time
    monkeypatch.setattr(model, "synced_time", lambda device: (seen.append(counters["stats"]["unique_graphs"]),
                                                              clock(device))[1])
    torch._dynamo.reset()
    counters.clear()
    data = {"train_files": [str(assets / "data.jsonl")], "max_length": 96, "token_budget": 192,
            "max_batch_size": 2, "length_bucket": 16}
    config = write_config(assets, tmp_path / "run", data=data)
    target_tps, drafter_tps, _ = measure(str(config), ["target.compile=true", "train.grad_accum=1"], steps=6)
    assert target_tps > 0 and drafter_tps[0] > 0
    assert len(seen) == 2 * (6 + 6) and set(seen) == {seen[0]} and seen[0] >= 3  # 6 steps, then their 6 micro-batches


def test_launch_auto_measures_plans_and_builds_the_torchrun_command(assets, tmp_path, capsys):
    config = write_config(assets, tmp_path / "run")
    assert launch_main(["-c", str(config), "--target-gpus", "auto", "--nproc-per-node", "3", "--measure-steps", "1",
                        "--dry-run", "train.lr=2e-3"]) == 0
    out = capsys.readouterr().out
    assert "plan for 3 GPUs: colocated on 3 GPUs" in out and "measured per GPU: target" in out
    assert out.strip().splitlines()[-1].endswith(
        "--standalone -m dflash_train.distributed.run -c " + str(config)
        + " --colocated --max-in-flight 4 --heartbeat-timeout 30.0 train.lr=2e-3")
    assert launch_main(["-c", str(config), "--target-gpus", "2", "--drafter-gpus", "2", "--nproc-per-node", "2",
                        "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:29500", "--dry-run"]) == 0
    assert ("--nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint h:29500 --rdzv-id dflash-train -m "
            "dflash_train.distributed.run -c " + str(config) + " --target-ranks 2 --drafter-ranks 2") \
        in capsys.readouterr().out
