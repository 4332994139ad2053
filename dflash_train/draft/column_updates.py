"""A chunk's [rows, V] logit gradient updated at a few columns per row (a CE target's one-hot, the
selector's candidates) and cast to the dtype the head's product reads.

The gradient is the largest tensor a step writes. Written whole once, in the product's dtype: the few
updated columns are summed apart, in the gradient's own precision, and written after the cast (a
gather and a scatter of a few columns a row). Compiled, the whole-gradient pass is then the kernel
that forms it; an update formed as a comparison with every column number costs that kernel one
comparison per column and element, and a scatter before the cast would end the kernel and make the
cast a pass of its own. Every element is rounded once, as if the updates were made before the cast.
"""

from __future__ import annotations

import torch


def add_at(dlogits: torch.Tensor, index: torch.Tensor, amounts: torch.Tensor, dtype: torch.dtype,
           at_index: torch.Tensor | None = None) -> torch.Tensor:
    """`dlogits` [rows, V] plus `amounts` [rows, m] at each row's columns `index` [rows, m] (a column
    named twice in a row takes both amounts), in `dtype`. `at_index`: `dlogits` at `index` where the
    caller forms it from a few gathered numbers; compiled, a gather from `dlogits` itself makes the
    whole gradient a buffer of its own in its precision beside the cast one."""
    if index.shape[1] == 0:
        return dlogits.to(dtype)
    amounts = amounts.to(dlogits.dtype)
    at_index = dlogits.gather(1, index) if at_index is None else at_index.to(dlogits.dtype)
    same = index[:, :, None] == index[:, None, :]  # [rows, m, m]: a repeated column's totals agree
    totals = at_index + (same.to(amounts.dtype) * amounts[:, None, :]).sum(-1)
    return dlogits.to(dtype).scatter(1, index, totals.to(dtype))
