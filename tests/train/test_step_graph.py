"""train.cuda_graphs' step (train/step_graph.py) on CPU, run on its static buffers without capturing:
the same losses, statistics and weights as the plain step, batch after batch across bucket shapes;
and every place it cannot run refused with the key named. The captured graphs: tests/gpu."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dflash_train.checkpoint.local import latest_checkpoint
from dflash_train.config import ConfigError, build_config
from dflash_train.distributed.roles import check_single_process_keys
from dflash_train.train.loop import Trainer
from dflash_train.train.metrics import read_metrics
from dflash_train.train.shapes import bucket_shapes
from dflash_train.train.step_graph import StepGraphs


def test_the_static_buffer_step_trains_like_the_plain_step(make_run_config, shared_tiny_target):
    over = ["train.epochs=2", "data.length_bucket=32", "train.lr=1e-2"]
    plain = Trainer(make_run_config("plain", over), target=shared_tiny_target)
    graphed = Trainer(make_run_config("graphed", over), target=shared_tiny_target)
    graphed.stepper.graphs = StepGraphs(graphed.parts, graphed.cfg.objective, capture=False)
    assert plain.progress.total_steps >= 6
    for _ in range(plain.progress.total_steps):
        a, b = plain.train_step(), graphed.train_step()
        torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-5, atol=1e-6)
        for key in ("correct", "counted", "accepted", "grad_norm"):
            torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)
        assert a["tokens"] == b["tokens"]
    assert len(graphed.stepper.graphs.graphs) >= 2  # several bucket shapes, one set of buffers each
    for (name, p), q in zip(plain.parts.drafter.named_parameters(), graphed.parts.drafter.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
        assert q.grad is not None and not q.grad.any()  # zeroed in place after each step, never None
    graphed.parts.drafter.layers[0].mlp.gate_proj.weight.grad = None
    with pytest.raises(RuntimeError, match="or its .grad was replaced"):
        graphed.train_step()


def test_a_whole_run_through_the_static_buffer_step(make_run_config, shared_tiny_target):
    """fit with held-out probes and checkpoints between the steps: the same metrics, held-out scores
    and final weights as the plain run's; a run resumed from a checkpoint continues alike."""
    heldout = make_run_config().data.train_files[0]
    over = ["train.max_steps=6", "data.length_bucket=32", "train.lr=1e-2", "checkpoint.every=3",
            f"eval.heldout_files=[{heldout}]", "eval.heldout_every=3", "train.log_every=1"]
    runs = {}
    for name in ("plain", "graphed", "resumed"):
        trainer = Trainer(make_run_config(name, over), target=shared_tiny_target)
        if name != "plain":
            trainer.stepper.graphs = StepGraphs(trainer.parts, trainer.cfg.objective, capture=False)
        if name == "resumed":  # stop at step 3, then a new trainer resumes from that checkpoint
            trainer.progress.total_steps = 3
            trainer.fit(progress=False)
            trainer = Trainer(make_run_config(name, over), target=shared_tiny_target)
            trainer.resume(latest_checkpoint(trainer.cfg.run_dir))
            trainer.stepper.graphs = StepGraphs(trainer.parts, trainer.cfg.objective, capture=False)
        trainer.fit(progress=False)
        runs[name] = (trainer, read_metrics(trainer.cfg.run_dir), (Path(trainer.cfg.run_dir) / "heldout.jsonl").read_text())
    plain, metrics, probes = runs["plain"]
    for name in ("graphed", "resumed"):
        trainer, got, got_probes = runs[name]
        assert [r["step"] for r in got] == [r["step"] for r in metrics] == list(range(1, 7))
        for a, b in zip(metrics, got):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["tau_hat"] == pytest.approx(a["tau_hat"], rel=1e-5)
        for a, b in zip(probes.splitlines(), got_probes.splitlines()):
            assert json.loads(b)["loss"] == pytest.approx(json.loads(a)["loss"], rel=1e-5)
        for p, q in zip(plain.parts.drafter.parameters(), trainer.parts.drafter.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        # fit prepared every bucket shape first, largest first: one features buffer serves them all
        graphs = trainer.stepper.graphs.graphs.values()
        assert len(graphs) == len(bucket_shapes(trainer.cfg.data))
        assert len({g.features.untyped_storage().data_ptr() for g in graphs}) == 1


def test_cuda_graphs_are_refused_where_they_cannot_run(make_run_config, shared_tiny_target):
    cuda = {"device": "cuda", "train": {"cuda_graphs": True}, "data": {"length_bucket": 256}}
    assert build_config(cuda).train.cuda_graphs
    for change, message in [({"device": "cpu"}, "runs on CUDA only"),
                            ({"data": {"length_bucket": 0}}, "set data.length_bucket"),
                            ({"train": {"cuda_graphs": True, "grad_accum": 2}}, "train.grad_accum is 2"),
                            ({"train": {"cuda_graphs": True, "ce_kernel": "liger"}}, "use train.ce_kernel=chunked"),
                            ({"objective": {"feature_noise": 0.1}}, "set train.cuda_graphs=false or objective.feature_noise=0")]:
        with pytest.raises(ConfigError, match=message):
            build_config({**cuda, **change})
    cfg = make_run_config(overrides=["device=auto", "train.cuda_graphs=true", "data.length_bucket=32"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="train.cuda_graphs runs on CUDA only; this run's device is cpu"):
            Trainer(cfg, target=shared_tiny_target)
    with pytest.raises(ValueError, match="train.cuda_graphs captures the whole step of `dflash-train train`"):
        check_single_process_keys(build_config(cuda))  # launch refuses it on every rank, before loading
    plain = Trainer(make_run_config("plain", ["data.length_bucket=32"]), target=shared_tiny_target)
    on_gpu = replace(plain.parts, device=torch.device("cuda"))  # as a GPU rank of `launch` would be
    with pytest.raises(ValueError, match="single-process training"):
        StepGraphs.for_run(on_gpu, plain.cfg.objective, single_process=False)
