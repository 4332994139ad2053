"""Tracker backends for real: wandb offline (no account, no network) and TensorBoard event files."""

from __future__ import annotations

import json
import re

from dflash_train.config_training import TrackingConfig
from dflash_train.train.tracking import REDACTED, Tracker, flatten_metrics, scrub

SECRET = "sk-very-secret-0042"
CONFIG = {
    "checkpoint": {
        "remote": "s3://b/p",
        "endpoint_url": "https://user:pw1234@minio.local:9000",
        "secret_access_key": SECRET,
    },
    "data": {"token_budget": 4096},
    "objective": {"mask_token_id": 7},
    "hf_token": SECRET,
    "wandb": {"api_key": SECRET, "password": SECRET},
}
ACC = [0.9, 0.8, 0.7]


def test_scrub_redacts_secrets_but_keeps_config():
    clean = scrub(CONFIG)
    assert SECRET not in json.dumps(clean) and "pw1234" not in json.dumps(clean)
    assert clean["checkpoint"]["endpoint_url"] == f"https://{REDACTED}@minio.local:9000"
    assert clean["data"]["token_budget"] == 4096 and clean["objective"]["mask_token_id"] == 7
    assert CONFIG["hf_token"] == SECRET  # the caller's dict is untouched


def test_flatten_numbers_positions_from_one():
    assert flatten_metrics({"loss": 2, "acc": ACC, "eval": {"tau": 3.5}, "note": "x"}) == {
        "loss": 2.0,
        "acc/1": 0.9,
        "acc/2": 0.8,
        "acc/3": 0.7,
        "eval/tau": 3.5,
    }


def test_none_backend_passes_the_id_through(tmp_path):
    tracker = Tracker(TrackingConfig(backend="none"))
    assert tracker.start(tmp_path, CONFIG, run_id="abc") == "abc"
    tracker.log({"loss": 1.0}, step=1)
    tracker.finish()


def test_wandb_offline_run_and_resume_keep_the_id(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TrackingConfig(backend="wandb", project="dflash-test", run_name="r1")

    tracker = Tracker(cfg)
    run_id = tracker.start(tmp_path, CONFIG, manifest={"git": "abc123"})
    for step in (1, 2):
        tracker.log({"loss": 1.0 / step, "acc": ACC}, step=step)
    tracker.finish()

    resumed = Tracker(cfg)
    assert resumed.start(tmp_path, CONFIG, manifest={"git": "abc123"}, run_id=run_id) == run_id
    resumed.log({"loss": 0.1, "acc": ACC}, step=3)
    resumed.finish()

    # offline-run-<second>-<id>[-<n>]: both processes wrote under the one id (wandb appends -1 to
    # the directory when the resume starts within the same second).
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    ids = {re.fullmatch(r"offline-run-\d{8}_\d{6}-([^-]+)(-\d+)?", p.name).group(1) for p in runs}
    assert runs and ids == {run_id}
    history = (runs[0] / f"run-{run_id}.wandb").read_bytes()  # offline runs keep only this log
    assert all(key in history for key in (b"loss", b"acc/1", b"acc/3", b'"git"'))
    for path in (tmp_path / "wandb").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert SECRET.encode() not in data and b"pw1234" not in data, path


def test_tensorboard_events_hold_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(TrackingConfig(backend="tensorboard"))
    assert tracker.start(tmp_path, CONFIG, manifest=None, run_id=None) is None
    tracker.log({"loss": 2.0, "acc": ACC}, step=5)
    tracker.finish()

    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"loss", "acc/1", "acc/2", "acc/3"} <= set(acc.Tags()["scalars"])
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("acc/2")] == [(5, 0.8)]
    assert SECRET.encode() not in events[0].read_bytes()
