"""A run's logged timings replayed through the time budget: the length it fits and the lr it gives.

The step times of a run do not depend on how the budget plans it, so its `metrics.jsonl` (each
window's training seconds and pauses) can be replayed through `TimeBudget` and the refitted
schedule on a simulated clock. The result is compared with the cosine of a run that knew its final
length from the start (the closer, the less the estimates bent the schedule), and so is the lr the
run itself logged (`run_mean_gap`: its budget as it was then).

    python bench/budget_replay.py -c configs/smollm2-h200.yaml train.time_budget_minutes=4.0 \
        --metrics results/smollm2-h200/cuda-graphs/a32-graphs/metrics.jsonl --queued-seconds 23.2

`--queued-seconds`: time the logged windows left out (windows timed on the host before the fix of
2026-12-02: the device's queue at each window's end), spread evenly over them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_train.config import load_config
from dflash_train.train.budget import TimeBudget
from dflash_train.train.optim import schedule_of

MARKS = (500, 1000, 1500, 1600, 2000, 2500, 3000, 3100, 3500, 4000, 4500, 4600)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def windows(records: list[dict], queued_seconds: float) -> list[tuple[int, float, float]]:
    """(last step, seconds a step, pause seconds after it) per logged window; then the last window's
    step time on, without pauses, for a replay that fits more steps than the run made."""
    extra, before, out = queued_seconds / len(records), 0, []
    for r in records:
        out.append((r["step"], (r["tokens"] / r["tokens_per_s"] + extra) / (r["step"] - before), r["paused_s"]))
        before = r["step"]
    return [*out, (10**9, out[-1][1], 0.0)]


def replay(cfg, logged: list[tuple[int, float, float]], planned: int) -> dict:
    tc = cfg.train
    clock = Clock()
    budget = TimeBudget(tc.time_budget_minutes, 0, tc.compile_warmup_steps, tc.log_every, clock=clock)
    schedule, total, paused, step, factors = schedule_of(tc, planned), planned, 0.0, 0, []
    for end, per_step, pause in logged:
        while step < min(end, total):
            step += 1
            clock.now += per_step
            factors.append(schedule(step - 1))  # the factor this step trained at
            fitted = budget.steps_that_fit(step, planned, paused)
            if fitted and fitted != total:
                schedule, total = schedule.refit(step, fitted), fitted
        if step >= total:
            break
        clock.now += pause
        paused += pause
    ideal = schedule_of(tc, step)
    known = [ideal(i) for i in range(step)]
    gaps = [abs(f - k) for f, k in zip(factors, known)]
    return {"steps": step, "seconds": round(clock.now, 1), "deadline": round(budget.deadline, 1),
            "factors": factors, "known_length": known,
            "mean_gap": round(sum(gaps) / len(gaps), 4), "max_gap": round(max(gaps), 4)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--metrics", required=True, help="the run's metrics.jsonl")
    ap.add_argument("--queued-seconds", type=float, default=0.0)
    ap.add_argument("--planned", type=int, default=10**6, help="the steps the run's epochs allow")
    ap.add_argument("--out", help="JSON file of the result")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if not cfg.train.time_budget_minutes:
        raise SystemExit(f"{args.config}: train.time_budget_minutes is not set: nothing to replay")
    records = [json.loads(line) for line in Path(args.metrics).read_text().splitlines() if line.strip()]
    run = {r["step"]: r["lr"] / cfg.train.lr for r in records}  # what the run's own budget gave
    replayed = replay(cfg, windows(records, args.queued_seconds), args.planned)
    factors, known = replayed.pop("factors"), replayed.pop("known_length")
    replayed["lr_factor_at"] = {m: {"run": round(run[m], 4) if m in run else None, "replayed": round(factors[m - 1], 4),
                                    "known_length": round(known[m - 1], 4)} for m in MARKS if m <= len(factors)}
    own = schedule_of(cfg.train, records[-1]["step"])  # the cosine of the run's own final length
    result = {"metrics": args.metrics, "overrides": args.overrides, "queued_seconds": args.queued_seconds,
              "run_steps": records[-1]["step"],
              "run_mean_gap": round(sum(abs(f - own(step - 1)) for step, f in run.items()) / len(run), 4), **replayed}
    text = json.dumps(result, indent=2) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return result


if __name__ == "__main__":
    main()
