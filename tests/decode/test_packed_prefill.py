"""Packed prefills (decode/packed_prefill.py) against a forward of each prompt alone: one row of
tokens gives every prompt's last logits and writes its K/V at positions 0..len-1 of its own row
of the engine's cache; rows not admitted keep what they held; the rounding tokens write only at
the first row's last position (CPU: attention under the block-diagonal mask, forwards eager)."""

import pytest
import torch
from families import tiny_model
from tiny import tiny_target, tiny_windowed

from dflash_train.decode.graphed_engine import GraphedEngine, Job
from dflash_train.decode.packed_prefill import (MIN_TOKENS, PACK_PROMPTS, PACK_TOKENS, PackedPrefills,
                                                  packed_attention, packed_size, Packing)
from tests.decode.test_prefill import assert_prefilled, engine_cache


def test_packed_sizes_take_four_steps_an_octave():
    assert [packed_size(n) for n in (1, MIN_TOKENS, 513, 1024, 1025, 1300, 1537, 5000)] == \
        [MIN_TOKENS, 512, 640, 1024, 1280, 1536, 1792, 5120]
    for n in range(1, 40_000, 37):
        assert n <= packed_size(n) and (packed_size(n) <= 1.25 * n or packed_size(n) == MIN_TOKENS)


def test_an_admission_splits_by_prompts_and_tokens():
    assert PackedPrefills.pieces([10] * (PACK_PROMPTS + 1)) == [list(range(PACK_PROMPTS)), [PACK_PROMPTS]]
    half = PACK_TOKENS // 2
    assert PackedPrefills.pieces([half, half, 1, PACK_TOKENS + 5, 3]) == [[0, 1], [2], [3], [4]]


def test_packed_prefills_equal_a_prefill_of_each_prompt_alone():
    model = tiny_target(hidden=64).model
    cache = engine_cache(model, rows=6, length=256)
    for layer in cache.layers:  # what earlier answers left: rows not admitted must keep it
        layer.keys.normal_()
        layer.values.normal_()
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    prefills = PackedPrefills(model, cache, graphs=False)
    g = torch.Generator().manual_seed(0)
    written = torch.zeros(6, 256, dtype=torch.bool)
    for lengths, rows in [([5, 9, 3], [4, 0, 2]), ([70, 100, 1], [1, 5, 3]), ([7, 8], [2, 4])]:
        prompts = [torch.randint(1, 200, (n,), generator=g).tolist() for n in lengths]
        assert_prefilled(model, cache, prompts, rows, prefills.run(prompts, rows))
        for n, row in zip(lengths, rows):
            written[row, :n] = True
        written[rows[0], -1] = True  # the rounding tokens' one place
        for layer, (keys, values) in zip(cache.layers, before):
            assert torch.equal(layer.keys.transpose(1, 2)[~written], keys.transpose(1, 2)[~written])
            assert torch.equal(layer.values.transpose(1, 2)[~written], values.transpose(1, 2)[~written])
    assert sorted(prefills.shapes) == [(MIN_TOKENS, 128)]  # 17, 171 and 15 tokens: one shape


def test_packed_attention_never_crosses_a_prompt():
    """Against float64 SDPA of each prompt alone, causal, GQA (4 query heads on 2 K/V heads)."""
    g = torch.Generator().manual_seed(1)
    lengths, tokens = [3, 7, 1, 5], 20
    query = torch.randn(1, 4, tokens, 8, generator=g)
    key, value = (torch.randn(1, 2, tokens, 8, generator=g) for _ in range(2))
    sequence = torch.repeat_interleave(torch.arange(5), torch.tensor(lengths + [tokens - sum(lengths)]))
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.full((tokens - sum(lengths),), 99)])
    packing = Packing(torch.tensor([0, 3, 10, 11, 16]), 8, torch.where(sequence < 4, sequence, PACK_PROMPTS + 1),
                      positions, sequence < 4)
    out, _ = packed_attention(None, query, key, value, None, scaling=0.3, packing=packing)
    start = 0
    for n in lengths:
        span = slice(start, start + n)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, span].double(), key[:, :, span].double().repeat_interleave(2, 1),
            value[:, :, span].double().repeat_interleave(2, 1), is_causal=True, scale=0.3)
        torch.testing.assert_close(out[:, span].double(), expected.transpose(1, 2), atol=1e-6, rtol=1e-6)
        start += n
    assert torch.isfinite(out).all()


@pytest.mark.slow(seconds=60)  # two C++ graphs, symbolic in the row's length: ~40 s cold on 2 cores
def test_compiled_packed_prefills_equal_each_prompt_alone_at_every_row_length():
    """Compiled (inductor's C++ backend on CPU) before any admission (`compile_now`: a first graph,
    then one symbolic in the longest prompt too), three row lengths (512, 1,024 and 768 tokens) and
    longest prompts run through those graphs, no more compiled; each prompt's logits and K/V as its
    own eager forward gives them, and rows not admitted untouched."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # what dynamo remembers of packed_forward from other tests (e.g. a symbolic longest) goes
    counters.clear()
    model = tiny_target(hidden=64).model
    cache = engine_cache(model, rows=6, length=1024)
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()
    prefills = PackedPrefills(model, cache, graphs=False, compile=True)
    prefills.compile_now()
    assert counters["stats"]["unique_graphs"] == 2 and sorted(prefills.shapes) == [(MIN_TOKENS, 128), (MIN_TOKENS, 256)]
    g = torch.Generator().manual_seed(4)
    for lengths, rows in [([5, 9, 3], [4, 0, 2]), ([300, 400, 200], [1, 5, 3]), ([700], [2])]:
        idle = [row for row in range(6) if row not in rows]
        before = [(layer.keys[idle].clone(), layer.values[idle].clone()) for layer in cache.layers]
        prompts = [torch.randint(1, 200, (n,), generator=g).tolist() for n in lengths]
        assert_prefilled(model, cache, prompts, rows, prefills.run(prompts, rows))
        for layer, (keys, values) in zip(cache.layers, before):
            assert torch.equal(layer.keys[idle], keys) and torch.equal(layer.values[idle], values)
    assert prefills.compiled is not None, prefills.compile_error
    assert sorted(prefills.shapes) == [(512, 128), (512, 256), (768, 1024), (1024, 512)]
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]


@pytest.mark.slow(seconds=45)  # two C++ graphs
def test_an_engine_compiles_its_packed_prefills_in_its_build_and_answers_the_same():
    """GraphedEngine(compile_prefill=True): both graphs made while the engine builds, none while
    admissions bring new shapes, and the answers of the uncompiled engine, token for token (fp32)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # what dynamo remembers of packed_forward from other tests (e.g. a symbolic longest) goes
    counters.clear()
    model = tiny_target(hidden=64).model
    g = torch.Generator().manual_seed(5)
    lengths = (300, 5, 140, 9, 20, 33)  # the longest first: the cache never grows
    prompts = [torch.randint(1, 200, (n,), generator=g).tolist() for n in lengths]
    answers = []
    for compile_prefill in (False, True):
        engine = GraphedEngine(model, rows=2, stops=set(), pad_id=0, chunk=4, compile_prefill=compile_prefill)
        engine._build(max(lengths) + 7)  # what serving the first prompt builds: serving builds nothing more
        built = counters["stats"]["unique_graphs"]
        jobs = [Job(p, max_tokens=6) for p in prompts]
        waiting = list(jobs)
        engine.serve(lambda n: [waiting.pop(0) for _ in range(min(n, len(waiting)))], lambda job: None)
        answers.append([j.tokens for j in jobs])
    assert engine.prefills.compiled is not None, engine.prefills.compile_error
    assert built == 2 and sorted(engine.prefills.shapes)[:2] == [(MIN_TOKENS, 128), (MIN_TOKENS, 256)]
    assert len(engine.prefills.shapes) > 2  # the admissions' own shapes, served by the build's graphs
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    assert answers[0] == answers[1] and all(len(a) == 6 for a in answers[1])


def test_a_packed_prefill_that_cannot_compile_runs_uncompiled(monkeypatch, caplog):
    from dflash_train.decode import packed_prefill

    def fails(*args):
        raise RuntimeError("no kernel for this")
    monkeypatch.setattr(packed_prefill, "compiled", lambda fn, dynamic: fails)
    model = tiny_target(hidden=64).model
    cache = engine_cache(model, rows=2, length=256)
    prefills = PackedPrefills(model, cache, graphs=False, compile=True)
    prompts = [[5, 6, 7], [8, 9]]
    assert_prefilled(model, cache, prompts, [1, 0], prefills.run(prompts, [1, 0]))
    assert prefills.compiled is None and prefills.compile_error == "RuntimeError: no kernel for this"
    assert "compiling the packed prefill failed (RuntimeError: no kernel for this)" in caplog.text


class _Replay:
    """What a captured graph does, on CPU: its replay runs the captured forward again."""

    def __init__(self, forward, output):
        self.forward, self.output = forward, output

    def replay(self):
        self.output.copy_(self.forward())

    def pool(self):
        return None


def capture_as_cuda_does(forward, device, pool=None):
    """compiled_steps.capture_graph's sequence without CUDA: two eager warm-ups, then the captured call."""
    for _ in range(2):
        forward()
    output = forward()
    return _Replay(forward, output), output


def test_capturing_a_new_shape_leaves_the_rows_in_use_alone(monkeypatch):
    """A shape is captured when an admission first needs it, while other rows decode: its capture's
    forwards must write nowhere but the admitted rows (and the dead slot). Replays give the same
    prefill as an eager forward."""
    import dflash_train.decode.prefill as prefill
    monkeypatch.setattr(prefill, "capture_graph", capture_as_cuda_does)
    model = tiny_target(hidden=64).model
    cache = engine_cache(model, rows=4, length=512)
    prefills = PackedPrefills(model, cache, graphs=True)
    g = torch.Generator().manual_seed(3)
    first = [torch.randint(1, 200, (n,), generator=g).tolist() for n in (9, 14)]
    assert_prefilled(model, cache, first, [0, 1], prefills.run(first, [0, 1]))
    busy = [(layer.keys[:2].clone(), layer.values[:2].clone()) for layer in cache.layers]
    later = [torch.randint(1, 200, (n,), generator=g).tolist() for n in (299, 5)]  # a new shape
    assert_prefilled(model, cache, later, [2, 3], prefills.run(later, [2, 3]))
    assert len(prefills.shapes) == 2 and all(shape.graph is not None for shape in prefills.shapes.values())
    for layer, (keys, values) in zip(cache.layers, busy):
        assert torch.equal(layer.keys[:2], keys) and torch.equal(layer.values[:2], values)
    again = [torch.randint(1, 200, (n,), generator=g).tolist() for n in (4, 11)]  # the first shape, replayed
    assert_prefilled(model, cache, again, [1, 0], prefills.run(again, [1, 0]))


def test_models_whose_heads_flash_attention_cannot_take_keep_padded_prefills():
    """MLA (DeepSeek-V3): values narrower than keys; a head size flash attention has no kernel for."""
    mla = tiny_model("deepseek-v3")
    assert not GraphedEngine(mla, rows=2, stops=set(), pad_id=0).packed
    with pytest.raises(ValueError, match="keys of 16 and values of 8 per head"):
        GraphedEngine(mla, rows=2, stops=set(), pad_id=0, prefill="packed")
    with pytest.raises(ValueError, match=r"head size 4 \(flash attention: a multiple of 8 up to 256\)"):
        GraphedEngine(tiny_target(hidden=16).model, rows=2, stops=set(), pad_id=0, prefill="packed")


def test_models_with_windows_keep_padded_prefills():
    model = tiny_windowed("mistral").model
    assert not GraphedEngine(model, rows=2, stops=set(), pad_id=0).packed
    with pytest.raises(ValueError, match="packed prefills cannot run MistralForCausalLM: sliding-window layers"):
        GraphedEngine(model, rows=2, stops=set(), pad_id=0, prefill="packed")
    with pytest.raises(ValueError, match="compile_prefill compiles packed prefills; MistralForCausalLM prefills pad"):
        GraphedEngine(model, rows=2, stops=set(), pad_id=0, compile_prefill=True)
    with pytest.raises(ValueError, match="prefill must be auto, packed or padded"):
        GraphedEngine(tiny_target(hidden=64).model, rows=2, stops=set(), pad_id=0, prefill="ragged")
