"""Learning-rate schedules at hand-computed steps, and retargeting them to another run length."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_train.config import build_config
from dflash_train.train.optim import Schedule, build_scheduler, lr_factor, refit_scheduler, retarget_scheduler


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


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_refit_continues_without_a_jump_and_never_goes_back_up(schedule):
    """A time budget refits the length as its estimate moves: first down (the plan was 40 epochs),
    during the warmup, then up while decaying (later epochs run faster on cached features)."""
    plan = Schedule(1000, 0.1, 0.05, schedule, 0.2)
    short = plan.refit(30, 100)  # the plan's warmup is at 31%; 100 steps' warmup (10) is over
    assert short(30) == pytest.approx(plan(30))  # no jump
    rates = [short(s) for s in range(30, 101)]
    assert max(b - a for a, b in zip(rates, rates[1:])) <= 1 / 10 + 1e-12  # the new length's warmup slope
    assert max(rates) == pytest.approx(1.0) and rates[-1] == pytest.approx(0.05)
    longer = short.refit(85, 150)  # deep in the decay, the run turns out longer
    assert longer(85) == pytest.approx(short(85))
    tail = [longer(s) for s in range(85, 151)]
    assert all(b <= a + 1e-12 for a, b in zip(tail, tail[1:]))  # before, the stretched cosine rose again
    assert tail[-1] == pytest.approx(0.05) and tail[-2] > 0.05 + 1e-6  # the end of the decay is the new end
    assert short.refit(50, 100) is short and plan.refit(0, 1000) is plan  # the same length: untouched


def test_refitted_decay_follows_the_same_curve_when_the_length_is_kept():
    plan = Schedule(200, 0.1, 0.0, "cosine", 0.2)
    up = plan.refit(120, 300)
    done = (120 - 20) / (200 - 20)  # the progress the 200-step cosine had made at step 120
    assert up.position(210) == ("decay", pytest.approx(done + (1 - done) / 2))  # halfway through the rest
    again = up.refit(150, 200)  # up and back: the curve from 150 on is a 200-step one's
    remaining = [again(s) for s in range(150, 201)]
    assert remaining[0] == pytest.approx(up(150))
    assert remaining[-1] == pytest.approx(0.0) and all(b <= a for a, b in zip(remaining, remaining[1:]))


def test_a_refitted_schedule_survives_the_schedulers_state_dict():
    tc = build_config(overrides=["train.warmup_ratio=0.1", "train.lr=1.0"]).train
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=tc.lr)
    sched = build_scheduler(opt, tc, 1000)

    def run(scheduler, optimizer, steps):
        rates = []
        for _ in range(steps):
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return rates

    run(sched, opt, 30)
    refit_scheduler(sched, 100)
    run(sched, opt, 10)
    refit_scheduler(sched, 120)  # two refits: no fresh schedule rebuilds this one
    run(sched, opt, 5)
    saved = sched.state_dict()
    want = run(sched, opt, 20)
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=tc.lr)
    restored = build_scheduler(opt2, tc, 1000)
    restored.load_state_dict(saved)
    assert restored.lr_lambdas[0] == Schedule(1000, 0.1, 0.0, "cosine", 0.2).refit(30, 100).refit(40, 120)
    refit_scheduler(restored, 120)  # what a resumed budgeted run does: the same length, untouched
    assert run(restored, opt2, 20) == want


def test_a_refit_with_few_steps_left_still_ends_at_the_minimum():
    plan = Schedule(1000, 0.3, 0.0, "cosine", 0.2)
    late = plan.refit(30, 36)  # the warmup's slope would need 6+ more steps: it takes half of those left
    rates = [late(s) for s in range(30, 37)]
    assert rates[0] == pytest.approx(plan(30)) and max(rates) == pytest.approx(1.0)
    assert rates[-1] == pytest.approx(0.0)


def test_a_refit_to_a_length_without_warmup_steps_keeps_the_rate_of_its_step():
    plan = Schedule(1000, 0.01, 0.0, "cosine", 0.2)  # 10 warmup steps, 60% at step 5
    short = plan.refit(5, 40)  # 1% of 40 rounds to 0 warmup steps
    assert short(5) == pytest.approx(plan(5)) and short(6) == pytest.approx(1.0)


def test_a_refit_in_wsds_flat_part_moves_its_decay():
    plan = Schedule(100, 0.1, 0.0, "wsd", 0.2)  # flat from step 10, decay from step 80
    longer = plan.refit(50, 200)
    assert [longer(s) for s in (50, 159)] == [1.0, 1.0] and longer(161) < 1.0  # decay from 160
    assert longer(200) == pytest.approx(0.0)
