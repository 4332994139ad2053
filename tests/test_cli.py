"""The command line: config errors exit 2 with a message naming the key, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "dflash_train", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def test_bad_override_exits_2_naming_the_key(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("run_dir: runs/x\ntrain:\n  lr: 1.0e-3\n")
    done = run_cli("train", "-c", str(cfg), "train.lr=abc", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "train.lr" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "runs").exists(), "nothing may be started on a bad config"


def test_unknown_key_and_missing_file_exit_2(tmp_path):
    done = run_cli("train", "-c", str(tmp_path / "missing.yaml"), cwd=tmp_path)
    assert done.returncode == 2 and "not found" in done.stderr and "Traceback" not in done.stderr
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("train:\n  lrr: 1.0\n")
    done = run_cli("train", "-c", str(cfg), cwd=tmp_path)
    assert done.returncode == 2 and "train.lrr" in done.stderr and "Traceback" not in done.stderr
