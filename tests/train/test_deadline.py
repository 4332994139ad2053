"""One schedule across stop and resume: a deadline stops a fixed-length run without refitting its
schedule, and a resumed time-budgeted run continues the schedule it was on (no jump back up)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dflash_train.config import ConfigError
from dflash_train.train.loop import Trainer, train
from dflash_train.train.metrics import read_metrics


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def timed(trainer: Trainer, clock: FakeClock, seconds: float) -> Trainer:
    """Every step of `trainer` "takes" `seconds` on `clock`."""
    step = trainer.train_step

    def timed_step():
        clock.now += seconds
        return step()

    trainer.train_step = timed_step
    return trainer


def test_max_steps_with_a_time_budget_is_refused():
    from dflash_train.config import build_config

    with pytest.raises(ConfigError, match=r"train\.time_budget_minutes and train\.max_steps"):
        build_config(overrides=["train.max_steps=10", "train.time_budget_minutes=5"])
    build_config(overrides=["train.max_steps=10", "train.deadline_minutes=5"])  # the way to stop on time


def test_deadline_stop_then_resume_auto_keeps_every_lr_and_loss(make_run_config, shared_tiny_target, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("dflash_train.train.budget.perf_counter", clock)
    seen: dict[str, dict[int, tuple]] = {"straight": {}, "stopped": {}}  # step -> (lr, loss) of every step
    original = Trainer.train_step

    def recording(self):
        out = original(self)
        seen[Path(self.cfg.run_dir).name][self.progress.step] = (out["lr"], float(out["loss"]))
        return out

    monkeypatch.setattr(Trainer, "train_step", recording)
    common = ["train.max_steps=8", "train.warmup_ratio=0.3", "train.log_every=2"]
    Trainer(make_run_config("straight", common), target=shared_tiny_target).fit(progress=False)

    # 20 s a step: 60 s less the 3% reserve is reached after the 3rd step (between two log steps).
    cfg = make_run_config("stopped", common + ["train.deadline_minutes=1"])
    first = timed(Trainer(cfg, target=shared_tiny_target), clock, 20.0).fit(progress=False)
    assert (first["steps"], first["stopped"], first["total_steps"]) == (3, "deadline", 8)
    assert first["checkpoint"].endswith("step_00000003")

    second = train(cfg, resume="auto", target=shared_tiny_target, progress=False)  # clock stands still
    assert (second["steps"], second["stopped"]) == (8, "end")
    assert seen["stopped"] == seen["straight"]  # all 8 steps: the same rate and the same loss
    assert len(seen["straight"]) == 8 and len({lr for lr, _ in seen["straight"].values()}) > 4
    # Step 3 was logged at the deadline although log_every=2, so metrics.jsonl misses no step.
    assert [r["step"] for r in read_metrics(cfg.run_dir)] == [2, 3, 4, 6, 8]


def test_resumed_budgeted_run_continues_its_schedule(make_run_config, shared_tiny_target, monkeypatch):
    """Failed before: the resumed run retargeted to the full plan (lr jumped up), then refitted again."""
    clock = FakeClock()
    monkeypatch.setattr("dflash_train.train.budget.perf_counter", clock)
    overrides = ["train.epochs=20", "train.time_budget_minutes=1", "train.compile_warmup_steps=2",
                 "checkpoint.every=10"]
    cfg = make_run_config("a", overrides)
    done = timed(Trainer(cfg, target=shared_tiny_target), clock, 2.0).fit(progress=False)
    assert done["steps"] == 29  # 58.2 s of 2 s steps
    reference = read_metrics(cfg.run_dir)

    copy = make_run_config("b", overrides)
    shutil.copytree(cfg.run_dir, copy.run_dir)
    resumed = Trainer(copy, target=shared_tiny_target)
    resumed.resume(f"{copy.run_dir}/checkpoints/step_00000020")
    assert resumed.progress.total_steps == 29
    again = timed(resumed, clock, 2.0).fit(progress=False)
    assert again["steps"] == 29
    after = read_metrics(copy.run_dir)
    assert [r["step"] for r in after] == list(range(1, 30))
    for a, b in zip(after[20:], reference[20:]):
        assert a["lr"] == b["lr"] and a["loss"] == b["loss"], a["step"]


def test_launch_on_several_ranks_refuses_wall_clock_stops(make_run_config):
    """Only the logging rank would stop: the others would hang in its collectives."""
    from dflash_train.distributed.run import check_wall_clock_stops, drafter_runs

    cfg = make_run_config(overrides=["train.max_steps=8", "train.deadline_minutes=5"])
    check_wall_clock_stops(drafter_runs(cfg), world_size=1)
    with pytest.raises(ValueError, match=r"train\.deadline_minutes \(drafter drafter\): not supported"):
        check_wall_clock_stops(drafter_runs(cfg), world_size=2)
    budgeted = make_run_config(overrides=["train.time_budget_minutes=5"])
    with pytest.raises(ValueError, match=r"train\.time_budget_minutes"):
        check_wall_clock_stops(drafter_runs(budgeted), world_size=4)


def test_a_budgeted_checkpoint_without_a_saved_schedule_resumes_on_the_plain_one(make_run_config, shared_tiny_target,
                                                                                  monkeypatch):
    """Checkpoints written before schedules were objects hold no schedule: refitting the fresh plan's
    would restart its warmup mid-run; they resume on the plain schedule of the saved length."""
    import torch

    from dflash_train.train.optim import lr_factor

    clock = FakeClock()
    monkeypatch.setattr("dflash_train.train.budget.perf_counter", clock)
    overrides = ["train.epochs=20", "train.time_budget_minutes=1", "train.compile_warmup_steps=2",
                 "checkpoint.every=10", "train.warmup_ratio=0.1"]
    cfg = make_run_config("a", overrides)
    timed(Trainer(cfg, target=shared_tiny_target), clock, 2.0).fit(progress=False)
    old = f"{cfg.run_dir}/checkpoints/step_00000020/optimizer.pt"
    optim = torch.load(old, weights_only=False)
    optim["scheduler"]["lr_lambdas"] = [None]  # what LambdaLR saved for a plain function
    torch.save(optim, old)
    resumed = Trainer(make_run_config("a", overrides), target=shared_tiny_target)
    resumed.resume(f"{cfg.run_dir}/checkpoints/step_00000020")
    assert resumed.progress.total_steps == 29
    assert resumed.parts.optimizer.param_groups[0]["lr"] == pytest.approx(cfg.train.lr * lr_factor(20, 29, 0.1, 0.0))


def test_a_budgeted_resume_says_when_the_configs_schedule_keys_changed(make_run_config, shared_tiny_target,
                                                                       monkeypatch, caplog):
    """The saved schedule continues (its refits are part of the run); a changed key is not silent."""
    clock = FakeClock()
    monkeypatch.setattr("dflash_train.train.budget.perf_counter", clock)
    overrides = ["train.epochs=20", "train.time_budget_minutes=1", "train.compile_warmup_steps=2",
                 "checkpoint.every=10"]
    cfg = make_run_config("a", overrides)
    timed(Trainer(cfg, target=shared_tiny_target), clock, 2.0).fit(progress=False)
    changed = Trainer(make_run_config("a", overrides + ["train.warmup_ratio=0.3"]), target=shared_tiny_target)
    with caplog.at_level("WARNING", logger="dflash_train"):
        changed.resume(f"{cfg.run_dir}/checkpoints/step_00000020")
    assert "train.warmup_ratio changed" in caplog.text
    assert changed.parts.scheduler.lr_lambdas[0].warmup_ratio == cfg.train.warmup_ratio
