"""DFlash2's grouped convolution kernels (draft/grouped_conv_kernel.py) timed at the shapes we train,
one launch configuration at a time: microseconds a call forward and backward (the backward with the
sum of the programs' base-kernel shares), the bytes they must move over that time, and the
configuration with the least time over both shapes (geometric mean against the first listed).
Every configuration's outputs are checked against the first's before it is timed.

    python bench/grouped_conv.py --out grouped_conv.json
    python bench/grouped_conv.py --launch 64,4 32,4   # tokens,warps

Shapes: the SmolLM2 recipe's step (64 sequences x 64 anchors x block 16 = 65,536 block tokens, hidden
576, 9 groups of 64, 2 taps) and the Qwen3-8B shape's (512 anchors x 16 = 8,192, hidden 4,096, 64
groups), in bfloat16 as training runs them.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from dflash_train.draft import grouped_conv_kernel as kernel
from dflash_train.draft.grouped_conv_kernel import Launch

SHAPES = {"smollm2": (65_536, 576, 64), "qwen3-8b": (8_192, 4_096, 64)}  # tokens, hidden, group size
LAUNCHES = ["64,4", "32,4", "128,4", "128,8", "64,8", "32,2", "16,2"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launch", nargs="+", default=LAUNCHES, help="tokens,warps; the first is the baseline")
    p.add_argument("--taps", type=int, default=2)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def timed_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def inputs(tokens: int, hidden: int, group: int, taps: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    randn = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    return dict(x=randn(tokens, hidden), grad=randn(tokens, hidden),
                coeff=randn(tokens, taps, hidden // group) * 0.1, base=randn(taps, hidden).float())


def run_shape(t: dict, launches: list[Launch], block: int, iters: int) -> list[dict]:
    x, grad, coeff, base = t["x"], t["grad"], t["coeff"], t["base"]
    moved_forward = 2 * x.numel() * x.element_size()  # read x, write the output
    moved_backward = 3 * x.numel() * x.element_size()  # read the gradient and x, write x's gradient
    rows, reference = [], None
    for launch in launches:
        kernel.FORWARD = kernel.BACKWARD = launch
        forward = lambda: kernel.grouped_conv(x, coeff, base, block)  # noqa: E731
        def backward():
            grad_x, grad_coeff, shares = kernel.grouped_conv_backward(grad, x, coeff, base, block)
            return grad_x, grad_coeff, kernel.base_gradient(shares, base)
        outputs = (forward(), *backward())
        if reference is None:
            reference = outputs
        for got, want in zip(outputs, reference):
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * float(want.abs().max()))
        f_us, b_us = timed_us(forward, iters), timed_us(backward, iters)
        rows.append(dict(launch=launch._asdict(), forward_us=round(f_us, 2), backward_us=round(b_us, 2),
                         forward_gb_s=round(moved_forward / f_us / 1e3, 1),
                         backward_gb_s=round(moved_backward / b_us / 1e3, 1)))
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    launches = [Launch(*map(int, s.split(","))) for s in args.launch]
    kept = kernel.FORWARD, kernel.BACKWARD
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "taps": args.taps,
              "block": args.block, "shapes": {}}
    for name, (tokens, hidden, group) in SHAPES.items():
        rows = run_shape(inputs(tokens, hidden, group, args.taps), launches, args.block, args.iters)
        record["shapes"][name] = dict(tokens=tokens, hidden=hidden, group=group, rows=rows)
        for r in rows:
            print(f"{name:9s} {tuple(r['launch'].values())!s:14s} forward {r['forward_us']:8.1f} us "
                  f"({r['forward_gb_s']:6.0f} GB/s)  backward {r['backward_us']:8.1f} us ({r['backward_gb_s']:6.0f} GB/s)")
    kernel.FORWARD, kernel.BACKWARD = kept
    for way in ("forward", "backward"):
        def relative(i: int) -> float:
            return math.exp(sum(math.log(s["rows"][i][f"{way}_us"] / s["rows"][0][f"{way}_us"])
                                for s in record["shapes"].values()) / len(record["shapes"]))
        best = min(range(len(launches)), key=relative)
        record[f"best_{way}"] = dict(launch=launches[best]._asdict(), relative_to_first=round(relative(best), 3))
        print(f"{way.upper()} = {launches[best]!r}  # {relative(best):.3f}x the first's time")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
