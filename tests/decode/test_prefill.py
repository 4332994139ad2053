"""Fixed-shape prefills (decode/prefill.py) against a forward of each prompt alone: the same last
logits and the same K/V at the prompt's positions of its row of the engine's cache, whatever the
padding rows and the extra left padding of a wider shape; shapes are made once and reused (CPU:
forwards run eagerly)."""

import pytest
import torch
from tiny import tiny_target

from dflash_train.decode.packed_prefill import PackedPrefills
from dflash_train.decode.prefill import MIN_WIDTH, PREFILL_ROWS, Prefills, bucket
from dflash_train.decode.static_cache import ALIGN, PositionedCache, forward_at


def engine_cache(model, rows: int, length: int) -> PositionedCache:
    """An engine's cache of `rows` x `length`, zeroed (GraphedEngine._build's layout)."""
    probe = PositionedCache(model.config, ALIGN)
    zero = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    forward_at(model, probe, zero, zero)
    cache = PositionedCache(model.config, length)
    for layer, one in zip(cache.layers, probe.layers):
        layer.lazy_initialization(one.keys[:, :, :1].expand(rows, -1, -1, -1),
                                  one.values[:, :, :1].expand(rows, -1, -1, -1))
    return cache


def own_prefill(model, prompt: list[int]) -> PositionedCache:
    """The prompt alone through the model: its logits and K/V at positions 0..len-1."""
    own = PositionedCache(model.config, len(prompt))
    ids = torch.tensor([prompt], device=model.device)
    positions = torch.arange(len(prompt), device=model.device)[None]
    return forward_at(model, own, ids, positions, logits_to_keep=1).logits[0, -1], own


def assert_prefilled(model, cache, prompts, rows, logits):
    """Each prompt's last logits, and its K/V at positions 0..len-1 of its row of `cache`, as a
    forward of the prompt alone gives them."""
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        expected, own = own_prefill(model, prompt)
        torch.testing.assert_close(logits[i], expected, atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(cache.layers, own.layers):
            torch.testing.assert_close(mine.keys[row, :, : len(prompt)], theirs.keys[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.values[row, :, : len(prompt)], theirs.values[0], atol=1e-5, rtol=1e-5)


def test_bucket_is_the_next_power_of_two_at_least_the_floor():
    assert [bucket(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
    assert bucket(5, MIN_WIDTH) == MIN_WIDTH


def test_fixed_shape_prefills_equal_a_prefill_of_each_prompt_alone():
    model = tiny_target(hidden=64).model
    cache = engine_cache(model, rows=6, length=256)
    prefills = Prefills(model, cache, pad_id=0, graphs=False)
    g = torch.Generator().manual_seed(0)
    groups = [([5, 9, 3], [4, 0, 2]), ([70, 100], [1, 5]), ([7, 8, 2, 6], [3, 2, 0, 4])]  # the third reuses the first's shape
    for lengths, rows in groups:
        prompts = [torch.randint(1, 200, (n,), generator=g).tolist() for n in lengths]
        logits = prefills.run(prompts, rows)
        assert_prefilled(model, cache, prompts, rows, logits)
    assert sorted(prefills.shapes) == [(2, 128), (4, 64)]


def test_an_admission_splits_by_width_and_rows():
    lengths = [5, 70, 9, 200] + [3] * PREFILL_ROWS
    pieces = Prefills.pieces(lengths)
    assert pieces == [[0, 2] + list(range(4, 4 + PREFILL_ROWS - 2)), list(range(4 + PREFILL_ROWS - 2, 4 + PREFILL_ROWS)),
                      [1], [3]]


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_a_prefill_that_cannot_be_captured_runs_eagerly(monkeypatch, caplog, kind):
    """A forward CUDA graphs cannot hold still prefills: logged once, every shape eager from then on
    (padded and packed prefills share the capture, prefill.capture_prefill)."""
    import dflash_train.decode.prefill as prefill

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(prefill, "capture_graph", refuse)
    model = tiny_target(hidden=64).model
    cache = engine_cache(model, rows=2, length=1024)
    prefills = (Prefills(model, cache, pad_id=0, graphs=True) if kind == "padded" else
                PackedPrefills(model, cache, graphs=True))
    failed = "capturing a prefill failed" if kind == "padded" else "capturing a packed prefill failed"
    prompts = [[5, 6, 7], [8]]
    assert_prefilled(model, cache, prompts, [1, 0], prefills.run(prompts, [1, 0]))
    assert not prefills.graphs and "stream is capturing" in prefills.graph_error
    assert failed in caplog.text
    prompts = [[9] * 600]  # a second shape: eager, no second attempt
    assert_prefilled(model, cache, prompts, [1], prefills.run(prompts, [1]))
    assert len(prefills.shapes) == 2 and caplog.text.count(failed) == 1


def test_out_of_memory_in_a_capture_reaches_the_caller(monkeypatch):
    """Out of memory is the backend's to handle (it halves its rows), not a reason to give up graphs."""
    import dflash_train.decode.prefill as prefill

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(prefill, "capture_graph", out_of_memory)
    model = tiny_target(hidden=64).model
    prefills = Prefills(model, engine_cache(model, rows=2, length=128), pad_id=0, graphs=True)
    with pytest.raises(torch.OutOfMemoryError):
        prefills.run([[5, 6]], [0])
    assert prefills.graphs and prefills.graph_error is None
