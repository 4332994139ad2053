"""On CUDA, train.cuda_graphs (the drafter's step captured once per bucket shape and replayed): each
replay gives the eager step's sums and gradients, whatever shape ran before; a run trains like the
same compiled run without graphs; a replayed step never syncs the host. Run:
`python -m pytest tests/gpu -m gpu`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_train.train.loop import Trainer
from dflash_train.train.shapes import bucket_shapes, synthetic_batch
from dflash_train.train.step_graph import StepGraphs

from tiny import DFLASH2, GPU_RECIPE, no_host_sync, tiny_target, to_cuda  # tests/ is on sys.path (conftest.py)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


LISTED = [*DFLASH2, "data.length_bucket=0", "data.length_buckets=[48,96]", "objective.num_anchors_length=48"]
"""DFlash2 with listed buckets and anchors in proportion past 48 tokens: 8 a row at 48, 16 at 96."""
FAMILIES = pytest.mark.parametrize("family", [[], DFLASH2, LISTED], ids=["dflash", "dflash2", "dflash2-listed"])


def learning_target():
    target = to_cuda(tiny_target(num_layers=4, hidden=64))
    target.lm_head_weight.mul_(20)  # as conftest's shared target: a head whose CE can fall in a few steps
    return target


@FAMILIES
def test_each_replay_gives_the_eager_step_whatever_ran_before(make_run_config, family):
    trainer = Trainer(make_run_config(overrides=[*GPU_RECIPE, *family, "train.cuda_graphs=true"]),
                      target=learning_target())
    trainer.stepper.compile_buckets()
    graphs = trainer.stepper.graphs
    graphs._allocate_grads()
    grads = [grad for _, grad, _ in graphs.grads]
    for grad in grads:
        grad.fill_(0.5)  # the warm-up runs before each capture must leave .grad as it was
    shapes, p = bucket_shapes(trainer.cfg.data), trainer.parts
    graphs.prepare(shapes)
    assert all(bool((grad == 0.5).all()) for grad in grads)
    assert len(graphs.graphs) == len(shapes) >= 2
    eager = StepGraphs(p, trainer.cfg.objective, capture=False)  # the same step on its own buffers, not captured
    (a_rows, a_len), (b_rows, b_len) = shapes[:2]
    gen = torch.Generator().manual_seed(1)
    for seed, (rows, length) in enumerate([(a_rows, a_len), (b_rows, b_len), (a_rows, a_len)]):
        batch, feats = synthetic_batch(p.target, p.stream_layers, p.device, rows, length, gen)
        results = []
        for steps in (eager, graphs):
            trainer.parts.optimizer.zero_grad(set_to_none=False)
            out = steps.run(batch, feats, seed)
            results.append((out, [grad.clone() for grad in grads]))
        (want, want_grads), (got, got_grads) = results
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-4, msg=name)
        assert any(bool(g.any()) for g in want_grads)
        for w, g in zip(want_grads, got_grads):
            torch.testing.assert_close(g, w, rtol=2e-3, atol=1e-5)


@FAMILIES
def test_a_run_with_captured_steps_trains_like_the_plain_run(make_run_config, family):
    records, trainers = {}, {}
    for graphs in (False, True):
        cfg = make_run_config(f"graphs_{graphs}", overrides=[
            *GPU_RECIPE, *family, "train.max_steps=16", "train.log_every=1", "train.lr=1e-2",
            f"train.cuda_graphs={str(graphs).lower()}"])
        trainers[graphs] = trainer = Trainer(cfg, target=learning_target())
        trainer.fit(progress=False)
        records[graphs] = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert len(records[True]) == 16
    for key in ("loss", "grad_norm", "tau_hat"):
        torch.testing.assert_close(torch.tensor([r[key] for r in records[True]]),
                                   torch.tensor([r[key] for r in records[False]]), rtol=5e-3, atol=5e-3, msg=key)
    for p, q in zip(trainers[False].parts.drafter.parameters(), trainers[True].parts.drafter.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-2, atol=1e-3)
    # Every shape was captured before training: a replayed step makes no host sync ("error" raises
    # at the first synchronising call).
    with no_host_sync():
        trainers[True].train_step()
