"""Learning-rate schedules at hand-computed steps, and retargeting them to another run length."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_train.config import build_config
from dflash_train.train.optim import build_scheduler, lr_factor, retarget_scheduler


def test_cosine_at_given_steps():
    # 100 steps, warmup 10: steps 0..9 ramp, then cosine over the 90 steps after.
    assert lr_factor(0, 100, 0.1, 0.0) == pytest.approx(0.1)
    assert lr_factor(9, 100, 0.1, 0.0) == pytest.approx(1.0)
    assert lr_factor(10, 100, 0.1, 0.0) == pytest.approx(1.0)
    assert lr_factor(55, 100, 0.1, 0.0) == pytest.approx(0.5)  # halfway: cos(pi/2) = 0
    assert lr_factor(55, 100, 0.1, 0.2) == pytest.approx(0.6)  # 0.2 + 0.8 * 0.5
    assert lr_factor(99, 100, 0.1, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 89 / 90)))
    assert lr_factor(100, 100, 0.1, 0.1) == pytest.approx(0.1)


def test_wsd_at_given_steps():
    # 100 steps, warmup 10, decay_ratio 0.2: flat at 1 for steps 10..79, 1 - sqrt decay over 80..100.
    f = lambda step, min_lr=0.0: lr_factor(step, 100, 0.1, min_lr, "wsd", 0.2)  # noqa: E731
    assert f(0) == pytest.approx(0.1)
    assert f(9) == pytest.approx(1.0)
    assert f(10) == f(50) == f(79) == 1.0
    assert f(80) == pytest.approx(1.0)
    assert f(85) == pytest.approx(0.5)  # progress 1/4: 1 - sqrt(0.25)
    assert f(85, 0.2) == pytest.approx(0.6)  # 0.2 + 0.8 * 0.5
    assert f(99) == pytest.approx(1 - math.sqrt(19 / 20))
    assert f(100, 0.1) == pytest.approx(0.1)
    # A decay longer than the steps after the warmup starts right after it.
    assert lr_factor(2, 10, 0.2, 0.0, "wsd", 1.0) == pytest.approx(1.0)
    assert lr_factor(6, 10, 0.2, 0.0, "wsd", 1.0) == pytest.approx(1 - math.sqrt(0.5))


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_retarget_follows_the_new_length_from_the_current_step(schedule):
    tc = build_config(overrides=[f"train.schedule={schedule}", "train.warmup_ratio=0.1", "train.lr=1.0"]).train
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=tc.lr)
    sched = build_scheduler(opt, tc, 100)
    for _ in range(30):
        opt.step()
        sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(lr_factor(30, 100, 0.1, 0.0, schedule, 0.2))
    retarget_scheduler(sched, tc, 40)
    for step in range(30, 40):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_factor(step, 40, 0.1, 0.0, schedule, 0.2))
        opt.step()
        sched.step()
    retarget_scheduler(sched, tc, 40)  # the same length again: no change
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_factor(40, 40, 0.1, 0.0, schedule, 0.2))


def test_wsd_is_the_schedule_training_uses(make_run_config, shared_tiny_target):
    from dflash_train.train.loop import Trainer
    from dflash_train.train.metrics import read_metrics

    cfg = make_run_config(overrides=["train.max_steps=10", "train.warmup_ratio=0.2", "train.schedule=wsd",
                                     "train.decay_ratio=0.3"])
    Trainer(cfg, target=shared_tiny_target).fit(progress=False)
    logged = [r["lr"] for r in read_metrics(cfg.run_dir)]
    assert logged == pytest.approx([cfg.train.lr * lr_factor(s, 10, 0.2, 0.0, "wsd", 0.3) for s in range(10)])
    assert logged[2:7] == [cfg.train.lr] * 5  # the stable part
