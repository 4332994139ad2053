"""SIGTERM (a scheduler's preemption) and Ctrl-C during training: the step in flight finishes, a
checkpoint of it is saved, the process exits resumable, and the resumed run's losses are the
uninterrupted run's."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from dflash_train.checkpoint.local import list_checkpoints
from dflash_train.train.metrics import read_metrics
from dflash_train.train.stop_signals import EXIT_STATUS, StopSignals
from dist_runs import reference_losses, write_assets, write_config
from tiny import tiny_target

STEPS = 120


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return write_assets(tmp_path_factory.mktemp("assets"), tiny_target(num_layers=3, hidden=32))


@pytest.mark.slow(seconds=40)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_at_a_random_step_saves_it_and_the_resumed_run_matches(assets, tmp_path, signum):
    config = write_config(assets, tmp_path / "run", checkpoint={"every": 1000, "keep_last": 5},
                          train={"lr": 1e-3, "warmup_ratio": 0.0, "grad_accum": 2, "max_steps": STEPS, "log_every": 1})
    train = [sys.executable, "-m", "dflash_train", "train", "-c", str(config)]
    proc = subprocess.Popen(train, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_on)
    at = random.randint(2, STEPS // 2)
    deadline = time.monotonic() + 120
    while len(read_metrics(tmp_path / "run")) < at and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signum)
    signalled = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - signalled < 60  # checkpoint.grace_seconds
    assert proc.returncode == EXIT_STATUS[signal.Signals(signum).name], err[-3000:]
    saved = list_checkpoints(tmp_path / "run")
    assert len(saved) == 1 and at <= int(saved[0].name.removeprefix("step_")) < STEPS
    step = int(saved[0].name.removeprefix("step_"))
    assert len(read_metrics(tmp_path / "run")) == step
    name = signal.Signals(signum).name
    assert err.splitlines()[-1] == (f"{name}: stopped at step {step} of {STEPS}, saved in {saved[0]}; to go on: "
                                    f"dflash-train train -c {config} --resume auto")
    assert "Traceback" not in err

    resumed = subprocess.run([*train, "--resume", "auto"], capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = reference_losses(config, tmp_path / "ref")
    assert [r["loss"] for r in read_metrics(tmp_path / "run")] == pytest.approx(expected, abs=1e-6)


SECOND = """
import os, signal, sys, time
from dflash_train.train.stop_signals import StopSignals
with StopSignals(float(sys.argv[1])) as signals:
    os.kill(os.getpid(), signal.SIGTERM)
    print(signals.received, flush=True)
    if sys.argv[2] == "again":
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
"""


@pytest.mark.parametrize("then", ["again", "wait"])
def test_a_second_signal_or_the_grace_period_ends_the_process_at_once(then):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", SECOND, "1", then], capture_output=True, text=True, timeout=60)
    assert out.stdout == "SIGTERM\n" and time.monotonic() - start < 20
    if then == "again":
        assert out.returncode == -signal.SIGTERM and "SIGTERM again: stopping without waiting" in out.stderr
    else:
        assert out.returncode == 75 and "not saved within checkpoint.grace_seconds (1 s)" in out.stderr


def _ctrl_c_on():
    """Ctrl-C as in a terminal: a process started in the background (CI) inherits SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_second_ctrl_c_raises_keyboard_interrupt_in_the_loop():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _second_ctrl_c()
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_signal_the_process_ignores_stays_ignored():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals(60) as signals:
            os.kill(os.getpid(), signal.SIGINT)
            assert signals.received is None
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def _second_ctrl_c():
    with StopSignals(60) as signals:
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.received == "SIGINT" and 0 < signals.remaining() <= 60
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
