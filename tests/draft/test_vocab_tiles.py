"""The logits' row statistics from tiles (draft/vocab_tiles.py) against torch's own reductions and float64."""

import pytest
import torch

from dflash_train.draft.vocab_tiles import log_softmax, row_argmax, tiled_top_k


@pytest.mark.parametrize("vocab", [50, 300, 1000, 49152, 151936])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_the_one_pass_top_k_is_torchs_topk(vocab, k):
    """The tiles' maxima, then the top k of the k best tiles: the same values and ids as a full-width
    topk, in order, for vocabularies that are and are not a whole number of tiles."""
    x = torch.randn(37, vocab, generator=torch.Generator().manual_seed(vocab + k))
    x[0, :] = 0.0  # ties everywhere: the values still agree
    got, want = tiled_top_k(x, k), x.topk(k, dim=-1)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1][1:], want[1][1:])
    assert bool((x.gather(1, got[1]) == got[0]).all())


@pytest.mark.parametrize("k", [1, 4, 8])
def test_the_compiled_top_k_is_torchs_topk(k):
    """Compiled, the tiles' and the candidates' top k are k rounds of a row maximum (`small_top_k`):
    the same values and ids as `torch.topk`; where values tie, k distinct columns of the tied value."""
    x = torch.randn(19, 49152, generator=torch.Generator().manual_seed(k))
    x[0, :] = 0.0  # a padding row of the compiled chunk: every logit 0
    got = torch.compile(tiled_top_k, dynamic=False)(x, k)
    want = x.topk(k, dim=-1)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1][1:], want[1][1:])
    assert bool((x.gather(1, got[1]) == got[0]).all())
    assert all(len(set(row.tolist())) == k for row in got[1])


def _stats(x):
    log_q, tile_max = log_softmax(x)
    return log_q, row_argmax(x, tile_max), tile_max


@pytest.mark.parametrize("vocab", [300, 4096, 49152])
def test_the_compiled_tile_statistics_are_the_log_softmax_and_argmax(vocab):
    """Compiled, the log-softmax from the tiles' maxima and sums equals the float64 log-softmax of the
    row, and the argmax from the best tile is torch's (the first column of the maximum) also where
    the maximum repeats across tiles; a vocabulary not a whole number of tiles takes the plain path."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(23, vocab, generator=gen) * 8
    x[0, :] = 0.0  # a padding row: every column ties
    x[1, 7] = x[1, vocab - 3] = 100.0  # the maximum twice, in different tiles
    x[2, :] = -1e4  # far from zero: the tiles' shift keeps exp finite
    log_q, argmax, tile_max = torch.compile(_stats, dynamic=False)(x)
    torch.testing.assert_close(log_q.double(), torch.log_softmax(x.double(), -1), rtol=1e-6, atol=1e-5)
    assert torch.equal(argmax, x.argmax(-1))
    assert (tile_max is None) == (vocab % 64 != 0)
    if tile_max is not None:
        assert torch.equal(tile_max, x.view(23, -1, 64).amax(-1))
        got = tiled_top_k(x, 4, tile_max)
        torch.testing.assert_close(got[0], x.topk(4, -1)[0])


def test_eager_statistics_are_torchs_reductions():
    """Uncompiled, no tiles: torch's log_softmax and argmax themselves."""
    x = torch.randn(5, 4096, generator=torch.Generator().manual_seed(1))
    log_q, argmax, tile_max = _stats(x)
    assert tile_max is None
    assert torch.equal(log_q, torch.log_softmax(x, -1)) and torch.equal(argmax, x.argmax(-1))
