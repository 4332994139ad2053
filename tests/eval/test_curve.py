"""`dflash-train curve`: held-out tau_hat (and real tau where measured) against device-minutes."""

from __future__ import annotations

import json

import pytest

from dflash_train.cli import main
from dflash_train.eval.curve import run_curve


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_curve_reads_probe_and_real_tau_and_draws(tmp_path, capsys):
    run = tmp_path / "kl"
    run.mkdir()
    write(run / "heldout.jsonl", [{"step": 10, "device_seconds": 60.0, "tau_hat": 1.5},
                                  {"step": 20, "device_seconds": 150.0, "tau_hat": 1.9, "tau_decode": 1.8}])
    write(run / "eval.jsonl", [{"step": 20, "tau": 1.7}, {"step": 15, "tau": 1.6}])  # step 15: no probe record
    curve = run_curve(run)
    assert curve["heldout"] == [(1.0, 1.5), (2.5, 1.9)]
    assert curve["real"] == [(2.5, 1.7)]
    assert curve["decode"] == [(2.5, 1.8)]  # only where the probe replayed decoding
    assert main(["curve", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert "kl: tau_hat 1.900 at 2.5 device-minutes" in capsys.readouterr().out


def test_a_run_without_probe_records_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="heldout.jsonl"):
        run_curve(tmp_path)
