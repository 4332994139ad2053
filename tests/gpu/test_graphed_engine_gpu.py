"""On CUDA: the graphed generation engine, its decode step compiled and captured as a CUDA graph,
answers exactly as transformers' padded `generate` in fp32, refilling rows and regrowing its cache
on the way (the step compiled again for the grown cache), with SDPA over the whole cache or flex
decoding; and compiled flex decoding never reads the KV blocks past a row's position.
Run: `python -m pytest tests/gpu -m gpu -s`."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_train.decode.sampling import GenParams
from dflash_train.decode.graphed_engine import GraphedEngine, Job
from dflash_train.decode.greedy import generate_ids
from dflash_train.decode.flex_decode import KV_BLOCK, decode_block_mask, flex_decode_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eval.tiny_models import tiny_target  # noqa: E402
from decode.test_prefill import engine_cache, own_prefill  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("attention, prefill, compile_prefill",
                         [("sdpa", "padded", False), ("flex", "packed", False), ("flex", "packed", True)])
def test_graphed_engine_on_cuda_equals_the_padded_generate_in_fp32(attention, prefill, compile_prefill):
    model = tiny_target(vocab_size=256, num_layers=4, hidden_size=64).model
    model.config._attn_implementation = "sdpa"  # as load_target gives
    model.to("cuda", torch.float32)
    g = torch.Generator().manual_seed(0)
    lengths = [7, 30, 3, 12, 50, 9, 300, 21]  # the 300-token one regrows the cache past 256 positions
    prompts = [torch.randint(1, 255, (n,), generator=g).tolist() for n in lengths]
    stops = {17}
    padded = [generate_ids(model, [p], GenParams(temperature=0.0, top_p=1.0, max_tokens=40), stops, 0)[0]
              for p in prompts]
    engine = GraphedEngine(model, rows=3, stops=stops, pad_id=0, chunk=8, compile=True, attention=attention,
                           prefill=prefill, compile_prefill=compile_prefill)
    assert engine.flex == (attention == "flex") and engine.packed == (prefill == "packed")
    jobs = [Job(p, 40) for p in prompts]
    waiting = list(jobs)
    engine.serve(lambda n: [waiting.pop(0) for _ in range(min(n, len(waiting)))], lambda job: None)
    assert engine.steps.graphed and engine.steps.compiled == ["greedy"], (engine.steps.graph_error,
                                                                         engine.steps.compile_error)
    assert [(j.tokens, j.stopped) for j in jobs] == padded
    assert engine.length > 256
    # the prefills ran as captured graphs (an eager fallback would pass the equality above too)
    assert engine.prefills.graphs and engine.prefills.shapes, engine.prefills.graph_error
    if compile_prefill:  # compiled in each build (the cache regrew)
        assert engine.prefills.compiled is not None, engine.prefills.compile_error
    # every shape an admission ran was captured; the build's warm-up shapes (`compile_now`: compiled on
    # inert inputs) that no admission used never ran, so were never captured
    ran = [shape for shape in engine.prefills.shapes.values() if shape.logits is not None]
    assert ran and all(getattr(shape, "graph", None) is not None for shape in ran)


@pytest.mark.parametrize("compile", [False, True])
def test_packed_prefills_in_bf16_through_flash_attention_equal_each_prompt_alone(monkeypatch, compile):
    """bf16 packed prefills run varlen flash attention, captured as CUDA graphs (compiled first or
    not): each prompt's last logits and K/V in its row as an fp32 forward of the prompt alone gives
    them, to bf16's precision (relative error of each tensor below 6%: 3.3% at most in bf16 on CPU),
    over prompts longer and shorter than a flash block; the K/V checked after both admissions, so
    the second shape's capture must leave the rows filled before it alone."""
    from dflash_train.decode import packed_prefill
    calls = []
    flash = packed_prefill.varlen_attn
    monkeypatch.setattr(packed_prefill, "varlen_attn", lambda *a, **k: calls.append(1) or flash(*a, **k))
    fp32 = tiny_target(vocab_size=256, num_layers=4, hidden_size=256).model  # head_dim 64, GQA 4 / 2
    fp32.config._attn_implementation = "sdpa"
    fp32.to("cuda", torch.float32)
    model = copy.deepcopy(fp32).to(torch.bfloat16)
    cache = engine_cache(model, rows=6, length=512)
    prefills = packed_prefill.PackedPrefills(model, cache, graphs=True, compile=compile)
    prefills.compile_now()  # compiled: through varlen flash with every prompt empty (a no-op uncompiled)

    def close(mine, expected):
        assert (mine.float() - expected).norm() < 0.06 * expected.norm()
    g = torch.Generator().manual_seed(0)
    held = {}  # row: its prompt; each admission's new shape is captured while the earlier rows hold theirs
    for lengths, rows in [([7, 300, 1, 129], [5, 0, 3, 1]), ([64, 2], [2, 4])]:
        prompts = [torch.randint(1, 255, (n,), generator=g).tolist() for n in lengths]
        logits = prefills.run(prompts, rows)
        for i, (prompt, row) in enumerate(zip(prompts, rows)):
            close(logits[i], own_prefill(fp32, prompt)[0])
            held[row] = prompt
    for row, prompt in held.items():
        for mine, theirs in zip(cache.layers, own_prefill(fp32, prompt)[1].layers):
            close(mine.keys[row, :, : len(prompt)], theirs.keys[0])
            close(mine.values[row, :, : len(prompt)], theirs.values[0])
            close(mine.keys[row, :, 0], theirs.keys[0, :, 0])  # alone: one bad position in 300 is ~7% of the whole
            close(mine.values[row, :, 0], theirs.values[0, :, 0])
    assert calls, "the flash path never ran"
    assert (prefills.compiled is not None) == compile, prefills.compile_error
    used = [(512, 512), (512, 128)]  # the admissions' shapes (437 and 66 tokens); compile_now adds (512, 256)
    assert prefills.graphs and sorted(prefills.shapes) == sorted(used + ([(512, 256)] if compile else []))
    assert all(prefills.shapes[key].graph is not None for key in used)


def test_compiled_flex_decoding_never_reads_past_a_rows_reach():
    """NaN in every KV block past a row's position changes nothing: those blocks are not read (the
    eager reference would turn them into NaN outputs)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, heads, kv_heads, dim, length = 4, 9, 3, 64, 4 * KV_BLOCK
    query = torch.randn(rows, heads, 1, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    key, value = (torch.randn(rows, kv_heads, length, dim, generator=g, device="cuda", dtype=torch.bfloat16)
                  for _ in range(2))
    positions = torch.tensor([[0], [KV_BLOCK - 1], [KV_BLOCK], [length - 1]], device="cuda")
    attend = torch.compile(lambda k, v: flex_decode_attention(None, query, k, v, decode_block_mask(positions, length, 3),
                                                              scaling=0.125)[0], fullgraph=True)
    clean = attend(key, value)
    for row, reach in enumerate([1, 1, 2, 4]):
        key[row, :, reach * KV_BLOCK:], value[row, :, reach * KV_BLOCK:] = float("nan"), float("nan")
    assert torch.equal(attend(key, value), clean)
    reference = F.scaled_dot_product_attention(
        query.double().reshape(rows, kv_heads, 3, dim), key.double().nan_to_num(), value.double().nan_to_num(),
        attn_mask=torch.arange(length, device="cuda") <= positions[:, None, None], scale=0.125)
    torch.testing.assert_close(clean.double(), reference.reshape(rows, heads, 1, dim).transpose(1, 2), atol=2e-2, rtol=2e-2)
