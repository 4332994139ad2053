"""Fixed-shape prefills (generate/prefill.py) against a forward over each group's own shape: the
same last logits and the same K/V at the prompts' positions, whatever the padding rows and the
extra left padding of a wider shape; shapes are made once and reused (CPU: forwards run eagerly)."""

import pytest
import torch
from tiny import tiny_target

from dflash_train.generate.prefill import MIN_WIDTH, Prefills, bucket
from dflash_train.targets.static_cache import ALIGN, PositionedCache, forward_at


def left_padded(prompts: list[list[int]], pad: int):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    positions = torch.empty((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        positions[i] = torch.cat([torch.arange(len(p), width), torch.arange(len(p))])
    return ids, positions


def kv_shapes_of(model):
    """Each layer's key and value of one token, as the engine reads them (GraphedEngine._kv_shapes)."""
    probe = PositionedCache(model.config, ALIGN)
    forward_at(model, probe, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    return [(layer.keys[:, :, :1], layer.values[:, :, :1]) for layer in probe.layers]


def test_bucket_is_the_next_power_of_two_at_least_the_floor():
    assert [bucket(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
    assert bucket(5, MIN_WIDTH) == MIN_WIDTH


def test_fixed_shape_prefills_equal_a_prefill_of_the_prompts_own_shape():
    model = tiny_target(hidden=64).model
    config = model.config
    prefills = Prefills(model, kv_shapes_of(model), length=256, pad_id=0, graphs=False)
    g = torch.Generator().manual_seed(0)
    groups = [[torch.randint(1, 200, (n,), generator=g).tolist() for n in lengths]
              for lengths in ([5, 9, 3], [70, 100], [7, 8, 2, 6])]  # the third reuses the first's shape
    for prompts in groups:
        ids, positions = left_padded(prompts, pad=0)
        logits, shape = prefills.run(ids, positions)
        own = PositionedCache(config, ids.shape[1])
        expected = forward_at(model, own, ids, positions, logits_to_keep=1).logits[:, -1]
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        assert shape.width == bucket(ids.shape[1], MIN_WIDTH) and shape.rows == bucket(len(prompts))
        for mine, theirs in zip(shape.cache.layers, own.layers):
            for i, p in enumerate(prompts):  # each prompt's K/V at its positions 0..len-1
                at = positions[i, -len(p):]
                torch.testing.assert_close(mine.keys[i, :, at], theirs.keys[i, :, at], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(mine.values[i, :, at], theirs.values[i, :, at], atol=1e-5, rtol=1e-5)
    assert sorted(prefills.shapes) == [(2, 128), (4, 64)]


def test_a_prefill_that_cannot_be_captured_runs_eagerly(monkeypatch, caplog):
    """A forward CUDA graphs cannot hold still prefills: logged once, every shape eager from then on."""
    import dflash_train.generate.prefill as prefill

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(prefill, "capture_graph", refuse)
    model = tiny_target(hidden=64).model
    prefills = Prefills(model, kv_shapes_of(model), length=128, pad_id=0, graphs=True)
    ids, positions = left_padded([[5, 6, 7], [8]], pad=0)
    logits, _ = prefills.run(ids, positions)
    expected = forward_at(model, PositionedCache(model.config, 3), ids, positions, logits_to_keep=1).logits[:, -1]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert not prefills.graphs and "stream is capturing" in prefills.graph_error
    assert "capturing a prefill failed" in caplog.text
    prefills.run(*left_padded([[1] * 80], pad=0))  # a new shape: eager, no second attempt
    assert caplog.text.count("capturing a prefill failed") == 1


def test_out_of_memory_in_a_capture_reaches_the_caller(monkeypatch):
    """Out of memory is the backend's to handle (it halves its rows), not a reason to give up graphs."""
    import dflash_train.generate.prefill as prefill

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(prefill, "capture_graph", out_of_memory)
    model = tiny_target(hidden=64).model
    prefills = Prefills(model, kv_shapes_of(model), length=128, pad_id=0, graphs=True)
    with pytest.raises(torch.OutOfMemoryError):
        prefills.run(*left_padded([[5, 6]], pad=0))
    assert prefills.graphs and prefills.graph_error is None
