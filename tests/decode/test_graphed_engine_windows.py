"""The graphed engine on targets with sliding-window layers (and gpt-oss's attention sinks): two rows
for four prompts longer than the window (8) with answers past it, so rows are refilled over the
stale K/V of earlier answers; every answer equals a plain cache-free greedy loop's."""

import pytest
import torch
from tiny import tiny_windowed

from dflash_train.decode.graphed_engine import GraphedEngine, Job
from tests.decode.test_graphed_engine import plain_greedy, serve_all


@pytest.mark.parametrize("family", ["mistral", "gemma3", "gpt_oss"])
def test_refilled_rows_decode_as_plain_greedy(family):
    model = tiny_windowed(family).model
    g = torch.Generator().manual_seed(2)
    jobs = [Job(torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist(), max_tokens)
            for n, max_tokens in [(12, 24), (20, 9), (15, 24), (17, 16)]]
    engine = GraphedEngine(model, rows=2, stops=set(), pad_id=0, chunk=4)
    assert len(serve_all(engine, jobs)) == len(jobs)
    for job in jobs:
        assert (job.tokens, job.stopped) == plain_greedy(model, job.prompt, job.max_tokens, set())
    assert len({token for job in jobs for token in job.tokens}) > 10  # a model that repeats itself proves little
