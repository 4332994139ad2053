"""Held-out acceptance against device-minutes, one line per run: the chart recipes are compared on.

Reads each run's heldout.jsonl (the training-time probe: teacher-forced tau_hat on held-out answers,
and tau_decode, decoding replayed over them, with the device-seconds spent so far) and, when a run has one, eval.jsonl (real speculative decoding
every eval.every steps, placed at the device-seconds of the probe record of the same step).
"""

from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_curve(run_dir: str | Path) -> dict:
    """{name, heldout: [(device_minutes, tau_hat)], decode: [(device_minutes, tau_decode)], real:
    [(device_minutes, tau)]} of one run."""
    run_dir = Path(run_dir)
    probe = read_jsonl(run_dir / "heldout.jsonl")
    if not probe:
        raise FileNotFoundError(f"{run_dir}/heldout.jsonl: no held-out records (set eval.heldout_files)")
    minutes = {r["step"]: r["device_seconds"] / 60 for r in probe}
    real = [(minutes[r["step"]], r["tau"]) for r in read_jsonl(run_dir / "eval.jsonl") if r["step"] in minutes]
    decode = [(minutes[r["step"]], r["tau_decode"]) for r in probe if "tau_decode" in r]
    return {"name": run_dir.name, "heldout": [(minutes[r["step"]], r["tau_hat"]) for r in probe],
            "decode": decode, "real": real}


def write_chart(curves: list[dict], out: str | Path, title: str = "held-out acceptance per device-minute") -> Path:
    import matplotlib  # the optional `plot` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for curve in curves:
        xs, ys = zip(*curve["heldout"])
        line, = ax.plot(xs, ys, marker="o", ms=3, label=f"{curve['name']} (tau_hat, teacher-forced)")
        if curve["decode"]:
            dx, dy = zip(*curve["decode"])
            ax.plot(dx, dy, marker="^", ls=":", color=line.get_color(),
                    label=f"{curve['name']} (tau_decode, decoding replayed)")
        if curve["real"]:
            rx, ry = zip(*curve["real"])
            ax.plot(rx, ry, marker="s", ls="--", color=line.get_color(), label=f"{curve['name']} (real tau)")
    ax.set_xlabel("device-minutes (wall clock x devices held)")
    ax.set_ylabel("acceptance length")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
