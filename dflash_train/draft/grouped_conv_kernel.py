"""DFlash2's in-block grouped convolution on a GPU: one Triton kernel forward, one backward.

The convolution (draft/dflash2.py, `GroupedConv`) is a few multiply-adds per element, sixteen times a
step (4 layers, 2 sublayers, before and after); its cost is the passes over the activations. In
PyTorch ops, even compiled, its backward takes several: the input's gradient, the coefficients' (a
sum over each group's channels), the base kernel's (a sum over every token, a column reduction), each
a kernel that reads the activations again. Here each program takes a tile of tokens and one group's
channels, reads the gradient and the input once, and writes the input's and the coefficients'
gradients and its share of the base kernel's (summed over the programs afterwards, in a fixed order:
deterministic, no atomics). The math is `GroupedConv.convolve`'s, in fp32:

  out[t, c]       = sum_tap (base[tap, c] + coeff[t, tap, g(c)]) * x[t - tap, c]    (t - tap in t's block)
  d x[t, c]       = sum_tap (base[tap, c] + coeff[t + tap, tap, g(c)]) * d out[t + tap, c]
  d coeff[t, k, g] = sum_{c in g} d out[t, c] * x[t - k, c]
  d base[k, c]    = sum_t d out[t, c] * x[t - k, c]

A custom op (torch.library), so torch.compile calls the kernels as they are. CUDA only; the CPU and
the tests' references run `GroupedConv.convolve`'s PyTorch ops.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch


class Launch(NamedTuple):
    """How a kernel's programs cover the tokens: `tokens` a program (any count works: a tap's neighbour
    is read from memory, not from the tile), in `warps`. The defaults are the fastest that
    `python bench/grouped_conv.py` found on an H100 at both shapes it times
    (docs/benchmarks/throughput.md, "The convolution kernels' tiling")."""

    tokens: int
    warps: int


FORWARD = Launch(tokens=64, warps=4)
BACKWARD = Launch(tokens=64, warps=4)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def forward(x_ptr, coeff_ptr, base_ptr, out_ptr, n, H: tl.constexpr, G: tl.constexpr, GS: tl.constexpr,
                TAPS: tl.constexpr, BLOCK: tl.constexpr, TOK: tl.constexpr, COLS: tl.constexpr):
        group = tl.program_id(1)
        rows = tl.program_id(0) * TOK + tl.arange(0, TOK)
        lane = tl.arange(0, COLS)  # COLS: GS rounded up to a power of two, as tl.arange needs
        cols = group * GS + lane
        real = rows < n
        pos = rows % BLOCK
        acc = tl.zeros((TOK, COLS), dtype=tl.float32)
        for tap in tl.static_range(TAPS):
            inside = real & (pos >= tap)
            x = tl.load(x_ptr + (rows - tap)[:, None] * H + cols[None, :], mask=inside[:, None] & (lane < GS)[None, :],
                        other=0.0)
            c = tl.load(coeff_ptr + rows * (TAPS * G) + tap * G + group, mask=real, other=0.0)
            b = tl.load(base_ptr + tap * H + cols, mask=lane < GS, other=0.0)
            acc += (b.to(tl.float32)[None, :] + c.to(tl.float32)[:, None]) * x.to(tl.float32)
        tl.store(out_ptr + rows[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=real[:, None] & (lane < GS)[None, :])

    @triton.jit
    def backward(grad_ptr, x_ptr, coeff_ptr, base_ptr, grad_x_ptr, grad_coeff_ptr, grad_base_ptr, n,
                 H: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, TAPS: tl.constexpr, BLOCK: tl.constexpr,
                 TOK: tl.constexpr, COLS: tl.constexpr):
        tile, group = tl.program_id(0), tl.program_id(1)
        rows = tile * TOK + tl.arange(0, TOK)
        lane = tl.arange(0, COLS)
        cols = group * GS + lane
        real = rows < n
        pos = rows % BLOCK
        in_group = (lane < GS)[None, :]
        grad = tl.load(grad_ptr + rows[:, None] * H + cols[None, :], mask=real[:, None] & in_group, other=0.0)
        grad = grad.to(tl.float32)
        grad_x = tl.zeros((TOK, COLS), dtype=tl.float32)
        for tap in tl.static_range(TAPS):
            b = tl.load(base_ptr + tap * H + cols, mask=lane < GS, other=0.0).to(tl.float32)
            ahead = real & (pos + tap < BLOCK)  # the output tap places after this token, in its block
            g = tl.load(grad_ptr + (rows + tap)[:, None] * H + cols[None, :], mask=ahead[:, None] & in_group,
                        other=0.0)
            c = tl.load(coeff_ptr + (rows + tap) * (TAPS * G) + tap * G + group, mask=ahead, other=0.0)
            grad_x += (b[None, :] + c.to(tl.float32)[:, None]) * g.to(tl.float32)
            behind = real & (pos >= tap)  # the input this token's output reads at this tap
            x = tl.load(x_ptr + (rows - tap)[:, None] * H + cols[None, :], mask=behind[:, None] & in_group, other=0.0)
            product = grad * x.to(tl.float32)
            tl.store(grad_coeff_ptr + rows * (TAPS * G) + tap * G + group,
                     tl.sum(product, axis=1).to(grad_coeff_ptr.dtype.element_ty), mask=real)
            tl.store(grad_base_ptr + (tile * TAPS + tap) * H + cols, tl.sum(product, axis=0), mask=lane < GS)
        tl.store(grad_x_ptr + rows[:, None] * H + cols[None, :], grad_x.to(grad_x_ptr.dtype.element_ty),
                 mask=real[:, None] & in_group)

    return forward, backward


def _lanes(group_size: int) -> int:
    """A group's channels rounded up to a power of two (a Triton block's extent)."""
    return 1 << (group_size - 1).bit_length()


def _grid(n: int, groups: int, launch: Launch) -> tuple[int, int]:
    return (-(-n // launch.tokens), groups)


@torch.library.custom_op("dflash_train::grouped_conv", mutates_args=())
def grouped_conv(x: torch.Tensor, coeff: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [n, H] (whole blocks of `block_size` tokens), coeff [n, taps, groups], base [taps, H]."""
    n, h = x.shape
    taps, groups = coeff.shape[1:]
    out = torch.empty_like(x)
    launch = FORWARD
    _kernels()[0][_grid(n, groups, launch)](x, coeff, base, out, n, h, groups, h // groups, taps, block_size,
                                            launch.tokens, _lanes(h // groups), num_warps=launch.warps)
    return out


@grouped_conv.register_fake
def _(x, coeff, base, block_size):
    return torch.empty_like(x)


@torch.library.custom_op("dflash_train::grouped_conv_backward", mutates_args=())
def grouped_conv_backward(grad: torch.Tensor, x: torch.Tensor, coeff: torch.Tensor, base: torch.Tensor,
                          block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x's gradient, coeff's, each program's share [programs, taps, H] of base's in fp32: `base_gradient`
    adds them up, outside the op, so that torch.compile fuses that sum with what reads the gradient)."""
    n, h = x.shape
    taps, groups = coeff.shape[1:]
    launch = BACKWARD
    grid = _grid(n, groups, launch)
    grad_x, grad_coeff = torch.empty_like(x), torch.empty_like(coeff)
    shares = torch.empty(grid[0], taps, h, device=x.device, dtype=torch.float32)
    _kernels()[1][grid](grad, x, coeff, base, grad_x, grad_coeff, shares, n, h, groups, h // groups, taps,
                        block_size, launch.tokens, _lanes(h // groups), num_warps=launch.warps)
    return grad_x, grad_coeff, shares


@grouped_conv_backward.register_fake
def _(grad, x, coeff, base, block_size):
    programs = _grid(x.shape[0], coeff.shape[2], BACKWARD)[0]
    return torch.empty_like(x), torch.empty_like(coeff), x.new_empty(programs, *base.shape, dtype=torch.float32)


def base_gradient(shares: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The base kernel's gradient from the programs' shares, added in a fixed order (deterministic)."""
    return shares.sum(0).to(base.dtype)


def _setup(ctx, inputs, output):
    x, coeff, base, ctx.block_size = inputs
    ctx.save_for_backward(x, coeff, base)


def _backward(ctx, grad):
    x, coeff, base = ctx.saved_tensors
    grad_x, grad_coeff, shares = grouped_conv_backward(grad.contiguous(), x, coeff, base, ctx.block_size)
    return grad_x, grad_coeff, base_gradient(shares, base), None


grouped_conv.register_autograd(_backward, setup_context=_setup)
