"""Resume from S3 continues exactly like a local resume (real SeaweedFS server)."""

from __future__ import annotations

import json
import shutil

from tiny import tiny_target

from dflash_train.config import build_config
from dflash_train.checkpoint import local as ckpt
from dflash_train.train.loop import Trainer, train
from dflash_train.train.metrics import read_metrics


def _data(path):
    rows = [
        {"messages": [{"role": "user", "content": f"list {i}"},
                      {"role": "assistant", "content": " ".join(str(i * j) for j in range(8 + i % 7))}]}
        for i in range(24)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path, run, remote=None, endpoint=None):
    return build_config({
        "run_dir": str(tmp_path / run), "device": "cpu",
        "draft": {"num_layers": 1},
        "objective": {"block_size": 4, "mask_token_id": 258, "num_anchors": 8, "gamma": 4.0},
        "data": {"train_files": [str(tmp_path / "d.jsonl")], "max_length": 128, "token_budget": 512,
                 "max_batch_size": 4},
        "train": {"lr": 1e-3, "max_steps": 4, "log_every": 1},
        "checkpoint": {"every": 2, "keep_last": 5, "remote": remote, "endpoint_url": endpoint},
    })


def _losses(run_dir):
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}


def test_resume_from_s3_matches_local_resume(tmp_path, bucket, s3_env):
    _data(tmp_path / "d.jsonl")
    remote = f"s3://{bucket}/runs/a"
    straight = _cfg(tmp_path, "a", remote, s3_env.endpoint)
    train(straight, target=tiny_target(), progress=False)
    full = _losses(straight.run_dir)

    # Local resume from step 2 of a copy of the run.
    local = _cfg(tmp_path, "local")
    shutil.copytree(ckpt.checkpoints_dir(straight.run_dir) / "step_00000002",
                    ckpt.checkpoints_dir(local.run_dir) / "step_00000002")
    train(local, resume=str(ckpt.checkpoints_dir(local.run_dir) / "step_00000002"), target=tiny_target(),
          progress=False)

    # Remote resume on a "new machine": nothing local, the checkpoint comes from S3.
    fresh = _cfg(tmp_path, "fresh", remote=None, endpoint=s3_env.endpoint)
    train(fresh, resume=f"{remote}/step_00000002", target=tiny_target(), progress=False)

    assert _losses(local.run_dir)[3] == full[3] and _losses(local.run_dir)[4] == full[4]
    assert _losses(fresh.run_dir)[3] == full[3] and _losses(fresh.run_dir)[4] == full[4]


def test_trainer_keeps_training_with_wrong_credentials(tmp_path, bucket, s3_env, monkeypatch, caplog):
    _data(tmp_path / "d.jsonl")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    cfg = _cfg(tmp_path, "badcreds", f"s3://{bucket}/runs/b", s3_env.endpoint)
    trainer = Trainer(cfg, target=tiny_target())
    summary = trainer.fit(progress=False)
    assert summary["steps"] == 4
    assert ckpt.latest_checkpoint(cfg.run_dir).name == "step_00000004"
    text = caplog.text
    assert bucket in text and s3_env.endpoint in text
    assert "wrong-secret-value" not in text
