"""Background uploads and retention against a real S3 server (SeaweedFS, see conftest.py)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from dflash_train.checkpoint.s3 import MARKER, S3Store
from dflash_train.checkpoint.storage import prune_local, prune_remote, resolve_resume
from dflash_train.checkpoint.uploader import BackgroundUploader

MiB = 1024 * 1024


def _store(server, bucket, **kw) -> S3Store:
    return S3Store(
        f"s3://{bucket}/runs/a",
        endpoint_url=server.endpoint,
        multipart_threshold=5 * MiB,
        multipart_chunksize=5 * MiB,
        **kw,
    )


def _keys(server, bucket) -> list[str]:
    return sorted(o["Key"] for o in server.client().list_objects_v2(Bucket=bucket).get("Contents", []))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_wrong_credentials_warn_once_and_keep_local_copies(
    s3_env, bucket, make_checkpoint, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-9f")
    root = tmp_path / "checkpoints"
    ckpts = [make_checkpoint(root, step) for step in (100, 200, 300)]
    uploader = BackgroundUploader(_store(s3_env, bucket), keep_last=1, backoff_s=0.05)

    started = time.monotonic()
    for ckpt in ckpts:
        uploader.enqueue(ckpt)
    assert time.monotonic() - started < 0.5  # enqueue only queues
    assert uploader.wait(timeout=30)
    uploader.close()

    warnings = _warnings(caplog)
    assert len(warnings) == 3  # one per checkpoint, none per retry
    assert all(s3_env.endpoint in w and bucket in w for w in warnings)
    assert "step_00000100" in warnings[0] and "not-the-secret-9f" not in " ".join(warnings)
    assert uploader.failed == ["step_00000100", "step_00000200", "step_00000300"]
    assert not any(uploader.is_safe_to_delete(c) for c in ckpts)
    assert prune_local(root, keep_last=1, is_safe_to_delete=uploader.is_safe_to_delete) == []
    assert all(c.is_dir() for c in ckpts)


def test_server_killed_mid_upload_then_restarted_completes(s3_env, bucket, make_checkpoint, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dflash_train")
    ckpt = make_checkpoint(tmp_path / "checkpoints", 100, big=True)
    store = _store(s3_env, bucket, max_attempts=1, connect_timeout=2)
    restart = threading.Thread(target=lambda: (time.sleep(1.0), s3_env.start()))
    once = threading.Lock()

    def kill_after_first_part(**_):  # called from several transfer threads at once
        if once.acquire(blocking=False):
            s3_env.stop()  # SIGKILL while the other parts of the file are in flight
            restart.start()

    store.client.meta.events.register("after-call.s3.UploadPart", kill_after_first_part)
    uploader = BackgroundUploader(store, backoff_s=0.5, max_attempts=10)
    uploader.enqueue(ckpt)
    try:
        assert uploader.wait(timeout=60)
    finally:
        restart.join()
        uploader.close()

    assert any("retry" in r.getMessage() for r in caplog.records)  # it did fail, then retried
    assert _warnings(caplog) == [] and uploader.failed == []
    assert uploader.is_safe_to_delete(ckpt)
    got = resolve_resume(f"s3://{bucket}/runs/a", tmp_path / "resume", endpoint_url=s3_env.endpoint)
    assert (got / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()


def test_retention_local_and_remote(s3_env, bucket, make_checkpoint, tmp_path):
    root = tmp_path / "checkpoints"
    ckpts = {step: make_checkpoint(root, step) for step in (100, 200, 300, 400)}
    uploader = BackgroundUploader(_store(s3_env, bucket), keep_last=2)
    for step in (200, 300, 400):  # 100's upload never happened (e.g. the process died first)
        uploader.enqueue(ckpts[step])
    assert uploader.wait(timeout=30)
    uploader.close()

    # Remote: the newest two complete checkpoints, nothing left of older ones.
    assert {k.split("/")[2] for k in _keys(s3_env, bucket)} == {"step_00000300", "step_00000400"}
    # Local: 200 is uploaded and old -> deleted; 100 is old but only exists here -> kept.
    deleted = prune_local(root, keep_last=2, is_safe_to_delete=uploader.is_safe_to_delete)
    assert deleted == [ckpts[200]]
    assert sorted(p.name for p in root.iterdir()) == [
        "step_00000100",
        "step_00000300",
        "step_00000300.uploaded.json",
        "step_00000400",
        "step_00000400.uploaded.json",
    ]
    # The newest is never deleted, whatever is asked.
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        prune_local(root, keep_last=0)
    assert prune_local(root, keep_last=1) == [ckpts[100], ckpts[300]]  # no remote: all safe
    assert [p.name for p in root.iterdir() if p.is_dir()] == ["step_00000400"]


def test_remote_prune_deletes_marker_first_and_abandoned_uploads(s3_env, bucket, make_checkpoint, tmp_path):
    store = _store(s3_env, bucket)
    uploader = BackgroundUploader(store)
    for step in (100, 200, 300):
        uploader.enqueue(make_checkpoint(tmp_path, step))
    assert uploader.wait(timeout=30)
    uploader.close()
    client = s3_env.client()
    client.delete_object(Bucket=bucket, Key=f"runs/a/step_00000200/{MARKER}")  # an abandoned upload

    deletes = []
    store.client.meta.events.register(
        "before-parameter-build.s3.DeleteObject", lambda params, **_: deletes.append(params["Key"])
    )
    store.client.meta.events.register(
        "before-parameter-build.s3.DeleteObjects",
        lambda params, **_: deletes.extend(o["Key"] for o in params["Delete"]["Objects"]),
    )

    assert prune_remote(store, keep_last=1) == ["step_00000100", "step_00000200"]
    assert deletes[0] == f"runs/a/step_00000100/{MARKER}"
    assert {k.split("/")[2] for k in _keys(s3_env, bucket)} == {"step_00000300"}
    assert store.list_checkpoints() == (["step_00000300"], [])
