"""On CUDA: the graphed generation engine, its decode step compiled and captured as a CUDA graph,
answers exactly as transformers' padded `generate` in fp32, refilling rows and regrowing its cache
on the way (the step compiled again for the grown cache).
Run: `python -m pytest tests/gpu -m gpu -s`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dflash_train.generate.backends import GenParams
from dflash_train.generate.graphed_engine import GraphedEngine, Job
from dflash_train.generate.local_backend import generate_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eval.tiny_models import tiny_target  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_graphed_engine_on_cuda_equals_the_padded_generate_in_fp32():
    model = tiny_target(vocab_size=256, num_layers=4, hidden_size=64).model
    model.config._attn_implementation = "sdpa"  # as load_target gives
    model.to("cuda", torch.float32)
    g = torch.Generator().manual_seed(0)
    lengths = [7, 30, 3, 12, 50, 9, 300, 21]  # the 300-token one regrows the cache past 256 positions
    prompts = [torch.randint(1, 255, (n,), generator=g).tolist() for n in lengths]
    stops = {17}
    padded = [generate_ids(model, [p], GenParams(temperature=0.0, top_p=1.0, max_tokens=40), stops, 0)[0]
              for p in prompts]
    engine = GraphedEngine(model, rows=3, stops=stops, pad_id=0, chunk=8, compile=True)
    jobs = [Job(p, 40) for p in prompts]
    waiting = list(jobs)
    engine.serve(lambda n: [waiting.pop(0) for _ in range(min(n, len(waiting)))], lambda job: None)
    assert engine.steps.graphed and engine.steps.compiled == ["step"], (engine.steps.graph_error,
                                                                         engine.steps.compile_error)
    assert [(j.tokens, j.stopped) for j in jobs] == padded
    assert engine.length > 256
