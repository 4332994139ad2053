"""Updates of a chunk's [rows, V] logit gradient at a few columns per row (a CE target's one-hot, the
selector's candidates). Compiled, each is a comparison with the column number, fused into the kernel
that forms the gradient: a scatter would end that kernel, and the weighting and the cast that follow
would read and write the whole gradient once more. The column numbers are int32: an int64 comparison
is several instructions a GPU repeats for each of the gradient's elements. Eager, a scatter."""

from __future__ import annotations

import torch


def minus_at(dlogits: torch.Tensor, index: torch.Tensor, amount: float) -> torch.Tensor:
    """`dlogits` less `amount` at each row's column `index` (the one-hot of a CE target)."""
    if torch.compiler.is_compiling():
        columns = torch.arange(dlogits.shape[1], device=dlogits.device, dtype=torch.int32)
        return dlogits - amount * (columns[None, :] == index[:, None].int()).to(dlogits.dtype)
    return dlogits.scatter_add(1, index[:, None], dlogits.new_full((index.shape[0], 1), -amount))


def add_at(dlogits: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`dlogits` plus `values` [rows, n] at each row's columns `index` [rows, n] (the selector's score
    gradients at its candidates)."""
    if torch.compiler.is_compiling():
        columns = torch.arange(dlogits.shape[1], device=dlogits.device, dtype=torch.int32)
        index = index.int()
        for j in range(index.shape[1]):
            dlogits = dlogits + values[:, j, None].to(dlogits.dtype) * (columns[None, :] == index[:, j, None])
        return dlogits
    return dlogits.scatter_add(1, index, values.to(dlogits.dtype))
