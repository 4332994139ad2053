"""One knob swept at equal device-minutes: each run's last held-out probe record against the knob's
value, one panel per knob, and the training loss against steps of the first knob's runs:
    python bench/sweep_chart.py --out sweep.png \
        --sweep "peak lr" runs/lr5e-4=5e-4 runs/base=2e-3 runs/lr4e-3=4e-3 \
        --sweep "tokens per step" runs/tb05x=16384 runs/base=32768 runs/tb2x=65536
Each RUN_DIR=VALUE names a run directory with heldout.jsonl (the training-time probe) and
metrics.jsonl. Runs of one sweep must have had the same budget: the script says so when their
probes' device-seconds differ by more than 5%.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_train.eval.curve import read_jsonl


def sweep_points(specs: list[str]) -> list[dict]:
    """(run, value, device_minutes, tau_hat, tau_decode, loss) of each RUN_DIR=VALUE, from its last
    probe record, in order of value."""
    out = []
    for spec in specs:
        run, sep, value = spec.rpartition("=")
        if not sep:
            raise SystemExit(f"{spec}: expected RUN_DIR=VALUE")
        records = read_jsonl(Path(run) / "heldout.jsonl")
        if not records:
            raise SystemExit(f"{run}/heldout.jsonl: no probe records")
        last = records[-1]
        out.append({"run": Path(run).name, "value": float(value), "device_minutes": last["device_seconds"] / 60,
                    "tau_hat": last["tau_hat"], "tau_decode": last.get("tau_decode"), "loss": last["loss"],
                    "steps": last["step"]})
    minutes = [p["device_minutes"] for p in out]
    if max(minutes) > 1.05 * min(minutes):
        print(f"warning: unequal budgets in one sweep ({min(minutes):.2f}-{max(minutes):.2f} device-minutes)")
    return sorted(out, key=lambda p: p["value"])


def draw(sweeps: dict[str, list[dict]], loss_runs: dict[str, Path], out: Path) -> Path:
    import matplotlib  # the optional `plot` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps) + 1, figsize=(4.2 * (len(sweeps) + 1), 3.8))
    for ax, (knob, pts) in zip(axes, sweeps.items()):
        xs = [p["value"] for p in pts]
        ax.plot(xs, [p["tau_hat"] for p in pts], marker="o", label="tau_hat (teacher-forced)")
        if all(p["tau_decode"] is not None for p in pts):
            ax.plot(xs, [p["tau_decode"] for p in pts], marker="^", ls=":", label="tau_decode (decoding replayed)")
        for p in pts:
            ax.annotate(f"{p['steps']} steps", (p["value"], p["tau_hat"]), fontsize=7, xytext=(3, 4),
                        textcoords="offset points")
        if min(xs) > 0:  # rates and batch sizes are swept by factors
            ax.set_xscale("log", base=2)
            ax.minorticks_off()
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.set_xlabel(knob)
        ax.set_ylabel(f"held-out acceptance at {pts[0]['device_minutes']:.2f} device-min")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    last_step = max(p["steps"] for pts in sweeps.values() for p in pts)
    shown = []  # the losses drawn past the first 5% of the steps: the first ones would flatten the rest
    for label, run in loss_runs.items():
        rows = read_jsonl(run / "metrics.jsonl")
        if not rows:
            raise SystemExit(f"{run}/metrics.jsonl: no training records")
        rows = [r for r in rows if r["step"] <= 1.1 * last_step]
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1, label=label)
        shown += [r["loss"] for r in rows if r["step"] >= 0.05 * last_step]
    ax.set_xlim(0, 1.1 * last_step)  # a longer reference run is drawn over the sweep's steps only
    if shown:
        ax.set_ylim(min(shown) - 0.2, max(shown) + 0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("training loss", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", nargs="+", action="append", required=True, metavar="KNOB RUN_DIR=VALUE",
                    help="a knob's name, then its runs")
    ap.add_argument("--loss-run", action="append", default=[], metavar="LABEL=RUN_DIR",
                    help="also draw this run's training loss (default: the first sweep's runs)")
    ap.add_argument("--out", default="sweep.png")
    args = ap.parse_args(argv)
    for knob, *specs in args.sweep:
        if not specs:
            raise SystemExit(f"--sweep {knob!r}: no RUN_DIR=VALUE after the knob's name")
    sweeps = {knob: sweep_points(specs) for knob, *specs in args.sweep}
    first = args.sweep[0]
    loss_runs = dict(s.split("=", 1) for s in args.loss_run) if args.loss_run else {}
    loss_runs = {k: Path(v) for k, v in loss_runs.items()} or {
        f"{first[0]} {s.rpartition('=')[2]}": Path(s.rpartition("=")[0]) for s in first[1:]}
    for knob, pts in sweeps.items():
        for p in pts:
            decode = f"{p['tau_decode']:.3f}" if p["tau_decode"] is not None else "-"
            print(f"{knob} {p['value']:g} ({p['run']}): {p['steps']} steps, tau_hat {p['tau_hat']:.3f}, "
                  f"tau_decode {decode}, loss {p['loss']:.3f}")
    print(draw(sweeps, loss_runs, Path(args.out)))
    return sweeps


if __name__ == "__main__":
    main()
