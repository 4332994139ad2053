"""The held-out probe: tau_hat on held-out answers every N steps, against device-seconds, across resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_train.data.dataset import tokenize_files
from dflash_train.checkpoint.local import latest_checkpoint
from dflash_train.train.heldout import replay_heldout, score_heldout
from dflash_train.train.loop import Trainer


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "heldout.jsonl").read_text().splitlines()]


def test_probe_scores_heldout_every_n_steps_and_at_the_end(make_run_config, shared_tiny_target):
    base = make_run_config()
    heldout = base.data.train_files[0]  # any conversation file serves as held-out answers here
    cfg = make_run_config(overrides=["train.max_steps=5", f"eval.heldout_files=[{heldout}]", "eval.heldout_every=2"])
    trainer = Trainer(cfg, target=shared_tiny_target)
    trainer.fit(progress=False)
    got = records(cfg.run_dir)
    assert [r["step"] for r in got] == [2, 4, 5]
    seconds = [r["device_seconds"] for r in got]
    assert seconds == sorted(seconds) and seconds[0] > 0
    # The last record is the trained drafter's held-out score, computed the trainer's own way.
    dataset = tokenize_files([heldout], shared_tiny_target.tokenizer, cfg.data.max_length, skip_invalid=True)
    with trainer.parts.forward.evaluating():
        direct = score_heldout(trainer.parts, cfg, dataset)
    assert got[-1]["tau_hat"] == pytest.approx(direct["tau_hat"])
    assert got[-1]["loss"] == pytest.approx(direct["loss"])
    assert got[-1]["acc"] == direct["acc"] and len(direct["acc"]) == cfg.objective.block_size - 1
    # tau_decode: greedy decoding replayed over the answers' first 256 tokens (eval/replay.py, tested
    # there against real speculative decoding), the same figure when recomputed.
    with trainer.parts.forward.evaluating():
        replayed = replay_heldout(trainer.parts, dataset, cfg.eval.heldout_decode_tokens)
    assert got[-1]["decode_rounds"] == replayed["decode_rounds"] > 0
    assert got[-1]["tau_decode"] == pytest.approx(replayed["tau_decode"]) and got[-1]["tau_decode"] >= 1.0


def test_resumed_run_continues_the_device_seconds(make_run_config, shared_tiny_target):
    heldout = make_run_config().data.train_files[0]
    over = [f"eval.heldout_files=[{heldout}]", "eval.heldout_every=2", "checkpoint.every=2",
            "eval.heldout_decode_tokens=0"]
    first = make_run_config(overrides=["train.max_steps=2", *over])
    Trainer(first, target=shared_tiny_target).fit(progress=False)
    # Pretend the first run held its devices for 1000 s: the resumed run's clock must count on from there.
    path = Path(first.run_dir) / "heldout.jsonl"
    path.write_text(json.dumps({**records(first.run_dir)[-1], "device_seconds": 1000.0}) + "\n")
    longer = make_run_config(overrides=["train.max_steps=4", *over])
    trainer = Trainer(longer, target=shared_tiny_target)
    trainer.resume(latest_checkpoint(longer.run_dir))
    trainer.fit(progress=False)
    got = records(longer.run_dir)
    assert [r["step"] for r in got] == [2, 4] and "tau_decode" not in got[1]  # replay off
    assert 1000.0 < got[1]["device_seconds"] < 1000.0 + 60  # counted on from the first run, not from zero


@pytest.mark.slow(seconds=60)
def test_probe_runs_the_compiled_graphs_without_recompiling(make_run_config, shared_tiny_target):
    """The probe scores with the compiled layers and loss of training: it must reuse their graphs
    (training's bucket shapes, grad mode on), not recompile them after warm-up. Under no_grad, or
    with batches of other shapes, every bucket's graph recompiled at the first probe."""
    heldout = make_run_config().data.train_files[0]
    # Two buckets, 64 and 128, each holding real rows (60 to 68 tokens): a third, never filled, only
    # added a third of the compile time (cold: ~30 of its ~110 CPU-seconds).
    cfg = make_run_config(overrides=[
        "train.compile=true", "train.compile_loss=true", "data.length_bucket=64", "data.max_length=128", "train.max_steps=8",
        "train.log_every=2", f"eval.heldout_files=[{heldout}]", "eval.heldout_every=2"])
    trainer = Trainer(cfg, target=shared_tiny_target)
    trainer.fit(progress=False)
    assert [r["step"] for r in records(cfg.run_dir)] == [2, 4, 6, 8]
    metrics = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [2, 4, 6, 8]
    assert [m["recompiles_since_warmup"] for m in metrics] == [0, 0, 0, 0]
    assert trainer.parts.compilation.recompiles.since_warm == 0  # the last probe ran after the last record
