"""Speedup as served against acceptance length, one point per drafter and batch size, from
`bench/spec_speed.py` reports (each labelled by its file name or LABEL=FILE):
    python bench/speedup_vs_tau.py random=results/smollm2-h200/spec-speed/random_drafter.json \
        short=results/smollm2-h200/spec-speed/short_run_drafter.json \
        every=results/smollm2-h200/every-turn-32k/spec_speed.json --out speedup_vs_tau.png
Both caches static, both models under CUDA graphs (`decode/static_decode.py`). Per batch size, a line
through the origin is fitted (least squares): speedup = tau x (target step) / (round time) when a
round's cost does not depend on the drafter, so a new drafter's tau tells its speedup served this way.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def points(reports: dict[str, Path]) -> list[dict]:
    """(label, rows, tau, speedup) of every run that measured a speedup."""
    out = []
    for label, path in reports.items():
        for run in json.loads(Path(path).read_text())["runs"]:
            if run.get("speedup") is not None:
                out.append({"label": label, "rows": run["rows"], "tau": run["tau"], "speedup": run["speedup"]})
    return out


def slope(pts: list[dict], rows: int) -> float | None:
    """Least-squares speedup / tau through the origin for one batch size."""
    xs = [(p["tau"], p["speedup"]) for p in pts if p["rows"] == rows]
    return sum(t * s for t, s in xs) / sum(t * t for t, _ in xs) if xs else None


def draw(pts: list[dict], out: Path) -> Path:
    import matplotlib  # the optional `plot` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for rows, marker in ((1, "o"), (8, "s")):
        sel = [p for p in pts if p["rows"] == rows]
        if not sel:
            continue
        k = slope(pts, rows)
        top = max(p["tau"] for p in pts) * 1.1
        line, = ax.plot([0, top], [0, k * top], ls=":", label=f"batch {rows}: speedup = {k:.2f} x tau")
        ax.scatter([p["tau"] for p in sel], [p["speedup"] for p in sel], marker=marker, color=line.get_color())
        for p in sel:
            ax.annotate(p["label"], (p["tau"], p["speedup"]), textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("tau (tokens per round, bonus included)")
    ax.set_ylabel("speedup over the target alone")
    ax.set_xlim(left=0.8)
    ax.set_ylim(bottom=0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", help="spec_speed.py JSON files, optionally LABEL=FILE")
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args(argv)
    reports = {}
    for item in args.reports:
        label, _, path = item.rpartition("=")
        reports[label or Path(path).stem] = Path(path)
    pts = points(reports)
    if not pts:
        raise SystemExit(f"no run with a speedup in {list(reports.values())}")
    draw(pts, Path(args.out))
    for p in pts:
        print(f"{p['label']} batch {p['rows']}: tau {p['tau']:.2f}, speedup {p['speedup']:.2f}x")
    return pts


if __name__ == "__main__":
    main()
