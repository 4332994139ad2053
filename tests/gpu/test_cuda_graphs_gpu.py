"""On CUDA, train.cuda_graphs (the drafter's step captured once per bucket shape and replayed) trains
like the same compiled run without graphs: equal losses step by step across bucket shapes, the
graphs really captured and replayed, and a replayed step that never syncs the host. Run:
`python -m pytest tests/gpu -m gpu`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_train.train.loop import Trainer

from tiny import GPU_RECIPE, tiny_target, to_cuda  # tests/ is on sys.path (conftest.py)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_captured_steps_train_like_the_plain_compiled_step(make_run_config):
    losses, trainers = {}, {}
    for graphs in (False, True):
        target = to_cuda(tiny_target(num_layers=4, hidden=64))
        cfg = make_run_config(f"graphs_{graphs}", overrides=[
            *GPU_RECIPE, "train.max_steps=16", "train.log_every=1", f"train.cuda_graphs={str(graphs).lower()}"])
        trainers[graphs] = trainer = Trainer(cfg, target=target)
        trainer.fit(progress=False)
        records = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
        losses[graphs] = torch.tensor([r["loss"] for r in records])
    graphs = trainers[True].step_graphs
    assert len(graphs.graphs) >= 2 and all(g.graph is not None for g in graphs.graphs.values())
    assert len(losses[True]) == 16
    # The same kernels, captured: equal up to bf16 reduction order.
    torch.testing.assert_close(losses[True], losses[False], rtol=2e-3, atol=2e-3)
    # A replayed step makes no host sync ("error" raises at the first synchronising call).
    trainer = trainers[True]
    trainer.total_steps += 4
    for _ in range(3):  # past any bucket shape not captured yet
        trainer.train_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.train_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
