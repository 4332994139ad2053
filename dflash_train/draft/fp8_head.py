"""The loss's LM head in FP8 (`train.fp8_lm_head`): its two matmuls on the FP8 tensor cores.

At the Qwen3-8B shape the head over 151,936 tokens is ~40% of the drafter step's FLOPs, and
`draft.fp8` leaves it in bf16 (docs/benchmarks/throughput.md#fp8). Per chunk the loss runs two
matmuls through it (`loss._chunk_loss`): logits = h @ W^T and the hidden states' gradient
dlogits @ W. The head is frozen, so its weight is quantised once, in the two layouts the matmuls
need, and only the activations (h, dlogits) are cast per chunk.

Scaling is per row, float8_e4m3fn, as torchao's rowwise recipe: each row of h and of dlogits gets
its own scale; W one scale per vocabulary row for the logits and one per hidden column for the
gradient. The matmuls are `torch._scaled_mm` with bf16 output (what torchao's Float8Linear calls);
torchao itself is not used because its linear layer re-quantises the weight on every call and would
form a weight gradient this frozen head never needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max


def quantise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in float8_e4m3fn, the fp32 scale that multiplies it back), one scale per slice along `dim`
    (dim=-1: per row), the slice's largest magnitude mapped to e4m3's largest value."""
    amax = x.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    return (x.float() * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), amax / E4M3_MAX


def fp8_head_problem(weight: torch.Tensor) -> str | None:
    """Why this head cannot run its matmuls in FP8, or None: both dimensions divisible by 16."""
    vocab, hidden = weight.shape
    if vocab % 16 or hidden % 16:
        return (f"the FP8 kernels need the head's dimensions divisible by 16; it is {vocab} x {hidden}: "
                "set train.fp8_lm_head=false")
    return None


class Fp8Head:
    """The frozen LM head [V, H], quantised once for both of the loss's matmuls."""

    def __init__(self, weight: torch.Tensor):
        if problem := fp8_head_problem(weight):
            raise ValueError(f"train.fp8_lm_head: {problem}")
        with torch.no_grad():
            self.rows, self.row_scale = quantise(weight, dim=1)  # [V, H], [V, 1]: logits = h @ rows^T
            cols, self.col_scale = quantise(weight, dim=0)  # [V, H], [1, H]: grad = dlogits @ cols
        self.cols_t = cols.t().contiguous()  # _scaled_mm takes its second operand column-major
        self.row_scale_t = self.row_scale.t().contiguous()  # [1, V]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, V] of `h` [rows, H]."""
        a, scale = quantise(_pad_rows(h), dim=1)
        out = torch._scaled_mm(a, self.rows.t(), scale_a=scale, scale_b=self.row_scale_t, out_dtype=torch.bfloat16)
        return out[: h.shape[0]].float()

    def input_grad(self, dlogits: torch.Tensor) -> torch.Tensor:
        """dlogits [rows, V] @ W: bf16 [rows, H]."""
        a, scale = quantise(_pad_rows(dlogits), dim=1)
        out = torch._scaled_mm(a, self.cols_t.t(), scale_a=scale, scale_b=self.col_scale, out_dtype=torch.bfloat16)
        return out[: dlogits.shape[0]]


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows padded with zeros to a multiple of 16, which the FP8 kernels need of every dimension."""
    return F.pad(x, (0, 0, 0, -x.shape[0] % 16))
