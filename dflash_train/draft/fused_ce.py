"""Fused LM head + cross-entropy from maintained libraries (`train.ce_kernel`), CUDA only.

Our chunked loss (`loss.py`) materialises one chunk of logits at a time. These
kernels never hold a logits tensor: liger-kernel (`pip install "dflash-train[fused-ce]"`, Triton)
computes loss and argmax in one pass over the vocabulary and the gradient in its backward;
cut-cross-entropy (Apple's CCE, Triton) the same without an argmax, which a no-grad chunked pass
adds here for the acceptance metrics. Both return per-token losses (`reduction="none"`), so the
per-slot decay weights and the global normalisation stay ours and exact; rows of weight 0 are passed
as ignored. CCE runs with `filter_eps=None`: its default
skips small gradient terms, an approximation. Both need a bf16 head (the target in bf16), as our
chunked loss runs it under autocast.

What they cost that our chunked loss does not: host syncs. Liger counts the rows that are not
ignored (`.item()`) in its forward, and again in its backward, which recomputes the chunks for
per-token losses. CCE gathers those rows' indices (`nonzero`). Ignored rows still go through
liger's head matmul and CCE's argmax pass; only the CE itself skips them.
"""

from __future__ import annotations

import torch

KERNELS = ("chunked", "liger", "cce")
IGNORE = -100


def _require(kernel: str, h: torch.Tensor) -> None:
    if h.device.type != "cuda":
        raise ValueError(f"train.ce_kernel={kernel} runs on CUDA only (Triton kernels); this run is on "
                         f"{h.device.type}: use train.ce_kernel=chunked")


def _argmax(h: torch.Tensor, lm_head_weight: torch.Tensor, chunk_size: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([(h[s:s + chunk_size] @ lm_head_weight.t()).argmax(-1)
                          for s in range(0, h.shape[0], chunk_size)])


def fused_ce(kernel: str, h: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
             weights: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_k w_k * CE_k, [rows] 1.0 where the argmax is the label) for `h` [rows, H] through the
    frozen head `lm_head_weight` [V, H]: what `loss._chunk_loss` gives for the CE-only mix."""
    _require(kernel, h)
    if lm_head_weight.dtype != torch.bfloat16:
        raise ValueError(f"train.ce_kernel={kernel} needs the target in bfloat16 (its head is "
                         f"{lm_head_weight.dtype}): set target.dtype=bfloat16 or use train.ce_kernel=chunked")
    h = h.to(torch.bfloat16)
    targets = torch.where(weights > 0, labels, IGNORE)
    if kernel == "liger":
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        except ImportError as err:
            raise ImportError('train.ce_kernel=liger needs liger-kernel: pip install "dflash-train[fused-ce]"') from err
        out = liger_fused_linear_cross_entropy(h, lm_head_weight, targets, ignore_index=IGNORE, reduction="none",
                                               return_predicted_tokens=True)
        per_row, predicted = out.loss, out.predicted_tokens
    elif kernel == "cce":
        try:
            from cut_cross_entropy import linear_cross_entropy
        except ImportError as err:
            raise ImportError('train.ce_kernel=cce needs cut-cross-entropy: pip install "dflash-train[fused-ce]"') from err
        per_row = linear_cross_entropy(h, lm_head_weight, targets, ignore_index=IGNORE, reduction="none",
                                       filter_eps=None, impl="cce")
        predicted = _argmax(h, lm_head_weight, chunk_size)
    else:
        raise ValueError(f"train.ce_kernel={kernel!r}: one of {KERNELS}")
    return (per_row.float() * weights).sum(), (predicted == labels).float()
