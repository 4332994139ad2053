"""Row statistics of a loss chunk's [rows, V] logits, read once, from tiles of TILE columns.

The chunk's logits are the largest tensor of a step; each full pass over them costs about as much as
the loss's other work on them. Compiled, a row's log-sum-exp as one reduction over V takes passes of
its own (the maximum, then the sum of exponentials), the argmax another and the selector's top-k one
more. Over tiles of TILE columns, the maximum and the sum of exponentials of every tile are one
fused pass that also leaves the tile maxima, from which the row's log-sum-exp, its argmax and its
top-k follow on [rows, V / TILE] numbers and a gather of a few tiles. Eager (CPU, uncompiled loss),
the plain reductions: there nothing fuses, and the tiles would only add intermediate tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE = 64
"""Columns a tile of the vocabulary spans."""


def _tiled(x: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() and x.shape[-1] % TILE == 0 and x.shape[-1] > TILE


def log_softmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(`F.log_softmax(x, -1)` of `x` [n, V], the tile maxima [n, V / TILE] its log-sum-exp came
    from, or None where the tiles were not used)."""
    if not _tiled(x):
        return F.log_softmax(x, dim=-1), None
    tiles = x.view(x.shape[0], -1, TILE)
    tile_max = tiles.amax(-1)
    tile_sum = (tiles - tile_max[..., None]).exp().sum(-1)  # with the maxima: one pass over x
    row_max = tile_max.amax(-1, keepdim=True)
    log_sum = (tile_sum * (tile_max - row_max).exp()).sum(-1, keepdim=True).log()
    return (x - row_max) - log_sum, tile_max  # as log_softmax: the maximum off first, exact in fp32


def row_argmax(x: torch.Tensor, tile_max: torch.Tensor | None) -> torch.Tensor:
    """`x.argmax(-1)`: the first tile holding the row's maximum, then the first column of it there
    (the first column of the maximum, as argmax's ties go)."""
    if tile_max is None:
        return x.argmax(-1)
    best = tile_max.argmax(-1, keepdim=True)
    inside = x.view(x.shape[0], -1, TILE).gather(1, best[..., None].expand(-1, -1, TILE)).squeeze(1).argmax(-1)
    return best.squeeze(1) * TILE + inside


def tiled_top_k(x: torch.Tensor, k: int, tile_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, -1)` (sorted) of [n, V] from the tile maxima (`tile_max`, or formed here): the k
    largest lie in the k tiles with the largest maxima (a tile holding one of them has a maximum at
    least the k-th largest, and at most k tiles do), so the top k of those k tiles. A full-width topk
    reads a row many times (a radix select per slice)."""
    n, v = x.shape
    if v <= k * TILE:
        return x.topk(k, dim=-1)
    if v % TILE:
        x = F.pad(x, (0, -v % TILE), value=float("-inf"))
    tiles = x.view(n, -1, TILE)
    best = small_top_k(tiles.amax(-1) if tile_max is None else tile_max, k)[1]  # [n, k]
    values, where = small_top_k(tiles.gather(1, best[..., None].expand(-1, -1, TILE)).flatten(1), k)
    return values, best.gather(1, where // TILE) * TILE + where % TILE


def small_top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, -1)` of [n, m] for a small k. Compiled, k rounds of a row maximum, each masking the
    column it took: a few fused passes over `x`, where `torch.topk` is a radix select of several
    kernels (most of the top-k's time on a GPU). Ties go to the lower column; eager, `torch.topk`."""
    if not torch.compiler.is_compiling():
        return x.topk(k, dim=-1)
    columns = torch.arange(x.shape[-1], device=x.device, dtype=torch.int32)
    values, ids = [], []
    for _ in range(k):
        value, index = x.max(-1)
        values.append(value)
        ids.append(index)
        x = x.masked_fill(columns == index[:, None].int(), float("-inf"))
    return torch.stack(values, 1), torch.stack(ids, 1)
