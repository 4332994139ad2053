"""The graphed engine (continuous batching on a static per-row cache) against the padded `generate`
and a plain token-by-token greedy loop, on the tiny random target (CPU: the step runs eagerly)."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest
import torch

from dflash_train.decode.sampling import GenParams
from dflash_train.generate.config import LocalConfig, build_generate_config
from dflash_train.decode.graphed_engine import GraphedEngine, Job, sample
from dflash_train.generate.local_backend import LocalBackend, encode_prompt
from dflash_train.config import ConfigError
from tests.generate.test_generate_local import PROMPTS


def plain_greedy(model, prompt: list[int], max_tokens: int, stops: set[int]) -> tuple[list[int], bool]:
    """The reference: the whole sequence through the model once per new token, no cache."""
    ids, new = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            new.append(token)
            ids.append(token)
            if token in stops:
                return new, True
    return new, False


def serve_all(engine: GraphedEngine, jobs: list[Job]) -> list[Job]:
    waiting, order = deque(jobs), []
    engine.serve(lambda n: [waiting.popleft() for _ in range(min(n, len(waiting)))], order.append)
    return order


@pytest.fixture(scope="module")
def backend(tiny_target):
    return LocalBackend.load(str(tiny_target), LocalConfig(device="cpu"))


def prompts_of(backend, n: int) -> list[list[int]]:
    """n distinct prompts of different lengths (the tiny tokenizer is byte-level)."""
    texts = [m[-1]["content"] for m in PROMPTS]
    return [encode_prompt(backend.tokenizer, [{"role": "user", "content": texts[i % 4] * (1 + i // 4)}], None)
            for i in range(n)]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_finished_rows_are_refilled_and_a_longer_prompt_regrows_the_cache_mid_answer(backend, attention):
    """Two rows for ten prompts of mixed lengths and budgets: rows are refilled (the stale K/V of
    the previous answer must stay invisible), and a long prompt arriving while the first row is
    mid-answer grows the cache under it (its K/V copied over, its decoding going on). With flex
    decoding each row reads its cache only up to its position (eagerly here: the same attention)."""
    model = backend.model
    prompts = prompts_of(backend, 8)
    long_prompt = prompts[-1] * 20  # past the first cache's 256 positions
    jobs = [Job(prompts[0], 40), Job(prompts[1], 2), Job(long_prompt, 12)]
    jobs += [Job(p, max_tokens=3 + 5 * (i % 3)) for i, p in enumerate(prompts[2:])]
    engine = GraphedEngine(model, rows=2, stops=set(), pad_id=0, chunk=4, attention=attention)
    assert engine.flex == (attention == "flex")
    grown_under = []
    build = engine._build

    def recording_build(positions):
        grown_under.append(len(jobs[0].tokens))
        build(positions)
    engine._build = recording_build
    finished = serve_all(engine, jobs)
    assert sorted(map(id, finished)) == sorted(map(id, jobs))
    assert engine.length >= len(long_prompt) + 12 + 1 > 256
    assert len(grown_under) == 2 and 0 < grown_under[1] < 40  # the second build happened mid-answer
    for job in jobs:
        assert (job.tokens, job.stopped) == plain_greedy(model, job.prompt, job.max_tokens, set())
    assert len({tuple(j.tokens) for j in jobs}) > 4  # a random model that says one thing proves nothing


def test_sampling_draws_from_softmax_over_temperature():
    """Gumbel-max per row against the float64 softmax; temperature 0 rows take the argmax."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    temperature = 0.7
    rows = 200_000
    draws = sample(logits.expand(rows, -1), torch.full((rows,), temperature))
    freq = torch.bincount(draws, minlength=5).double() / rows
    expected = torch.softmax(logits.double() / temperature, dim=0)
    assert torch.allclose(freq, expected, atol=4e-3), (freq, expected)
    mixed = sample(logits.expand(4, -1), torch.tensor([0.0, 1.0, 0.0, 1.0]))
    assert mixed[0] == mixed[2] == 0


def test_sampled_answers_through_the_backend_differ_from_greedy_and_repeat_with_the_seed(tiny_target):
    prompts = [m for m in PROMPTS]

    def answer(temperature: float, seed: int):
        backend = LocalBackend.load(str(tiny_target), LocalConfig(device="cpu", engine="graphed", batch_size=2))
        params = GenParams(temperature=temperature, top_p=1.0, max_tokens=16, seed=seed)

        async def run():
            try:
                return await asyncio.gather(*(backend.complete(m, params) for m in prompts))
            finally:
                await backend.aclose()
        return [a.text for a in asyncio.run(run())]

    greedy = answer(0.0, 0)
    padded = LocalBackend.load(str(tiny_target), LocalConfig(device="cpu", batch_size=4))

    async def run_padded():
        try:
            params = GenParams(temperature=0.0, top_p=1.0, max_tokens=16)
            return await asyncio.gather(*(padded.complete(m, params) for m in prompts))
        finally:
            await padded.aclose()
    assert greedy == [a.text for a in asyncio.run(run_padded())]
    assert answer(1.0, 5) == answer(1.0, 5) != greedy


def test_graphed_engine_refuses_top_p_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="sampling.top_p"):
        build_generate_config({"inputs": [str(tmp_path / "x.jsonl")], "output_dir": str(tmp_path / "o"),
                               "backend": "local", "sampling": {"top_p": 0.9}}, {"local.engine": "graphed"})


@pytest.mark.parametrize("prefill, forwards", [("padded", 3), ("packed", 1)])
def test_an_admission_prefills_its_prompts_together(backend, prefill, forwards):
    """Four free rows, prompts of 1x, 1x, 20x and 40x a short one. Padded: the short two share a
    prefill, each long one gets its own (padded to at most twice its length); packed: one row of
    tokens holds all four. Every answer is still the plain greedy one, each served in its own row."""
    model = backend.model
    short = prompts_of(backend, 2)
    jobs = [Job(short[0], 6), Job(short[1], 6), Job(short[0] * 20, 6), Job(short[1] * 40, 6)]
    engine = GraphedEngine(model, rows=4, stops=set(), pad_id=0, chunk=4, prefill=prefill)
    assert engine.packed == (prefill == "packed")
    serve_all(engine, jobs)
    assert engine.timings.prefills == forwards and engine.timings.chunks >= 2
    for job in jobs:
        assert (job.tokens, job.stopped) == plain_greedy(model, job.prompt, job.max_tokens, set())


def test_an_answer_that_cannot_be_turned_into_text_fails_its_request(tiny_target, monkeypatch):
    """Answers become text in the event loop: an error there must reach the caller, not hang it."""
    import dflash_train.generate.local_backend as local_backend

    def broken(*args, **kwargs):
        raise RuntimeError("cannot decode")
    backend = LocalBackend.load(str(tiny_target), LocalConfig(device="cpu", engine="graphed", batch_size=2))
    monkeypatch.setattr(local_backend, "completion", broken)

    async def ask():
        try:
            with pytest.raises(RuntimeError, match="cannot decode"):
                await asyncio.wait_for(backend.complete([{"role": "user", "content": "hi"}],
                                                        GenParams(temperature=0.0, top_p=1.0, max_tokens=4)), 60)
        finally:
            await backend.aclose()
    asyncio.run(ask())


@pytest.mark.parametrize("ahead", [1, 3])
def test_more_chunks_in_flight_give_the_same_answers_and_hand_no_stale_tokens_on(backend, ahead):
    """Two rows, eight short answers of different budgets: a row finishes while `ahead` chunks
    launched behind the one read still decode it; those chunks' tokens for it must not reach the
    job refilled into the row. Every answer equals the plain greedy one, and the host reads a chunk
    only once `ahead` more are queued behind it."""
    model = backend.model
    prompts = prompts_of(backend, 8)
    jobs = [Job(p, max_tokens=2 + 3 * (i % 4)) for i, p in enumerate(prompts)]
    engine = GraphedEngine(model, rows=2, stops=set(), pad_id=0, chunk=2, ahead=ahead)
    assert len(engine.host_tokens) == ahead + 1
    in_flight, deepest = [0], []
    launch, read = engine._launch, engine._read

    def counted_launch(*args):
        in_flight[0] += 1
        deepest.append(in_flight[0])
        return launch(*args)

    def counted_read(*args):
        in_flight[0] -= 1
        return read(*args)
    engine._launch, engine._read = counted_launch, counted_read
    serve_all(engine, jobs)
    for job in jobs:
        assert (job.tokens, job.stopped) == plain_greedy(model, job.prompt, job.max_tokens, set())
    assert max(deepest) == ahead + 1 and in_flight[0] == 0  # the one read, `ahead` behind it; all read


def test_no_chunk_in_flight_is_refused(backend):
    with pytest.raises(ValueError, match="ahead must be at least 1"):
        GraphedEngine(backend.model, rows=2, stops=set(), pad_id=0, ahead=0)


@pytest.mark.parametrize("prefill", ["padded", "packed"])
def test_a_growing_cache_holds_one_old_layer_at_a_time(backend, prefill):
    """A cache growth copies the rows layer by layer and frees each old layer once copied: nothing
    else (the packed prefills' hold on the old cache) may keep the rest alive, or the old and new
    caches would both sit in GPU memory at once."""
    import weakref

    from dflash_train.decode.static_cache import PositionedLayer
    engine = GraphedEngine(backend.model, rows=2, stops=set(), pad_id=0, prefill=prefill)
    engine._build(100)
    old = [weakref.ref(layer.keys) for layer in engine.cache.layers]
    alive, allocate = [], PositionedLayer.lazy_initialization

    def counting(layer, keys, values):
        alive.append(sum(ref() is not None for ref in old))
        return allocate(layer, keys, values)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PositionedLayer, "lazy_initialization", counting)
        engine._build(1000)
    layers = len(old)
    assert alive == list(range(layers, 0, -1)) and not any(ref() for ref in old)


def test_a_growth_mid_job_frees_the_old_steps_graph(backend, monkeypatch):
    """A prompt longer than the cache arrives while others decode: by the time the new cache is
    allocated, nothing holds the old decode step's graph (on a GPU: its memory pool) any more."""
    import gc
    import weakref

    import dflash_train.decode.prefill as prefill
    import dflash_train.compiled_steps as compiled_steps
    from dflash_train.decode.static_cache import PositionedLayer
    from tests.decode.test_packed_prefill import capture_as_cuda_does

    graphs = []

    class Graph:
        def __init__(self, step):
            self.step = step

        def replay(self):
            self.step()

    def graphed(step, device):  # what compiled_steps.graphed returns: a captured graph's replay
        graphs.append(weakref.ref(graph := Graph(step)))
        return graph.replay
    monkeypatch.setattr(compiled_steps, "graphed", graphed)
    monkeypatch.setattr(prefill, "capture_graph", capture_as_cuda_does)
    engine = GraphedEngine(backend.model, rows=2, stops=set(), pad_id=0, chunk=4, graphs=True)
    alive, allocate = [], PositionedLayer.lazy_initialization

    def counting(layer, keys, values):
        gc.collect()
        alive.append(sum(ref() is not None for ref in graphs))
        return allocate(layer, keys, values)
    monkeypatch.setattr(PositionedLayer, "lazy_initialization", counting)
    prompts = prompts_of(backend, 3)
    jobs = [Job(prompts[0], 20), Job(prompts[1], 3), Job(prompts[2] * 30, 4)]  # the third grows the cache
    serve_all(engine, jobs)
    layers = len(engine.cache.layers)
    assert len(alive) == 2 * layers and alive[layers:] == [0] * layers  # the growth: no old graph alive
    for job in jobs:
        assert (job.tokens, job.stopped) == plain_greedy(backend.model, job.prompt, job.max_tokens, set())
