"""Checkpoint upload / listing / resume against a real S3 server (SeaweedFS, see conftest.py)."""

from __future__ import annotations

import json

import pytest

from dflash_train.checkpoint.integrity import hash_checkpoint
from dflash_train.checkpoint.s3 import MARKER, RemoteStorageError, S3Store, S3Url
from dflash_train.checkpoint.storage import resolve_resume

MiB = 1024 * 1024


def _store(server, bucket, prefix="runs/a", **kw) -> S3Store:
    return S3Store(
        f"s3://{bucket}/{prefix}",
        endpoint_url=server.endpoint,
        multipart_threshold=5 * MiB,
        multipart_chunksize=5 * MiB,
        **kw,
    )


def _files(ckpt):
    return {p.relative_to(ckpt).as_posix(): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}


def test_s3_url_parsing():
    assert S3Url.parse("s3://b/x/y/") == S3Url("b", "x/y")
    assert S3Url.parse("s3://b").key("step_00000001", "f") == "step_00000001/f"
    assert str(S3Url.parse("s3://b/x")) == "s3://b/x"
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        S3Url.parse("/local/path")


def test_upload_list_download_roundtrip(s3_env, bucket, make_checkpoint, tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", 100, big=True)
    store = _store(s3_env, bucket)
    parts = []
    store.client.meta.events.register("before-call.s3.UploadPart", lambda **kw: parts.append(1))

    store.upload_checkpoint(ckpt, hash_checkpoint(ckpt))

    assert len(parts) >= 3  # the big file went up in >= 3 parts of 5 MiB
    assert store.list_checkpoints() == (["step_00000100"], [])
    marker = json.loads(
        s3_env.client().get_object(Bucket=bucket, Key=f"runs/a/step_00000100/{MARKER}")["Body"].read()
    )
    assert {f["name"] for f in marker["files"]} == set(_files(ckpt))

    got = resolve_resume(f"s3://{bucket}/runs/a", tmp_path / "resume", endpoint_url=s3_env.endpoint)
    assert got == tmp_path / "resume" / "step_00000100"
    assert _files(got) == _files(ckpt)
    assert [p.name for p in (tmp_path / "resume").iterdir()] == ["step_00000100"]  # no temp left
    # An existing, verified local copy is reused rather than downloaded again.
    assert resolve_resume(f"s3://{bucket}/runs/a", tmp_path / "resume", endpoint_url=s3_env.endpoint) == got


def test_local_resume_path_passes_through(tmp_path):
    assert (
        resolve_resume(tmp_path / "ck" / "step_00000005", tmp_path / "x") == tmp_path / "ck" / "step_00000005"
    )


def test_checkpoint_without_marker_is_never_picked(s3_env, bucket, make_checkpoint, tmp_path):
    store = _store(s3_env, bucket)
    for step in (100, 200):
        ckpt = make_checkpoint(tmp_path / "run", step)
        store.upload_checkpoint(ckpt, hash_checkpoint(ckpt))
    # An upload interrupted before its commit marker: all files there, no marker.
    s3_env.client().delete_object(Bucket=bucket, Key=f"runs/a/step_00000200/{MARKER}")

    assert store.list_checkpoints() == (["step_00000100"], ["step_00000200"])
    got = resolve_resume(f"s3://{bucket}/runs/a", tmp_path / "resume", endpoint_url=s3_env.endpoint)
    assert got.name == "step_00000100"
    with pytest.raises(RemoteStorageError, match="runs/a/step_00000200.*no commit marker") as err:
        resolve_resume(f"s3://{bucket}/runs/a/step_00000200", tmp_path / "r2", endpoint_url=s3_env.endpoint)
    assert s3_env.endpoint in str(err.value)
    assert not (tmp_path / "r2").exists()


def test_no_complete_checkpoint_is_a_clear_error(s3_env, bucket, tmp_path):
    with pytest.raises(RemoteStorageError, match=f"no complete checkpoint under s3://{bucket}/empty"):
        resolve_resume(f"s3://{bucket}/empty", tmp_path, endpoint_url=s3_env.endpoint)


def test_corrupted_object_is_detected_on_resume(s3_env, bucket, make_checkpoint, tmp_path):
    ckpt = make_checkpoint(tmp_path / "run", 300)
    store = _store(s3_env, bucket)
    store.upload_checkpoint(ckpt, hash_checkpoint(ckpt))
    key = "runs/a/step_00000300/optimizer.pt"
    data = bytearray((ckpt / "optimizer.pt").read_bytes())
    data[1000] ^= 0xFF  # same size, one flipped byte
    s3_env.client().put_object(Bucket=bucket, Key=key, Body=bytes(data))
    expected = next(e.sha256 for e in hash_checkpoint(ckpt) if e.name == "optimizer.pt")

    with pytest.raises(RemoteStorageError, match="checksum mismatch") as err:
        resolve_resume(f"s3://{bucket}/runs/a", tmp_path / "resume", endpoint_url=s3_env.endpoint)
    assert key in str(err.value) and expected[:16] in str(err.value)
    assert list((tmp_path / "resume").iterdir()) == []  # nothing half-downloaded left behind


def test_wrong_secret_is_a_clear_error_without_the_secret(s3_env, bucket, monkeypatch):
    wrong = "Wr0ng-Secret-Value-42"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    with pytest.raises(RemoteStorageError, match="wrong credentials") as err:
        _store(s3_env, bucket).check_access()
    message = str(err.value)
    assert s3_env.endpoint in message and bucket in message
    assert not err.value.transient
    for text in (message, repr(err.value.__cause__)):
        assert wrong not in text and s3_env.secret_key not in text


def test_missing_bucket_and_unreachable_endpoint(s3_env, dead_endpoint):
    with pytest.raises(RemoteStorageError, match="bucket does not exist") as err:
        _store(s3_env, "no-such-bucket-here").check_access()
    assert "no-such-bucket-here" in str(err.value) and s3_env.endpoint in str(err.value)

    store = S3Store("s3://somebucket/p", endpoint_url=dead_endpoint)
    with pytest.raises(RemoteStorageError, match="endpoint unreachable") as err:
        store.check_access()
    assert dead_endpoint in str(err.value) and "somebucket" in str(err.value) and err.value.transient


def test_check_access_passes_with_good_credentials(s3_env, bucket):
    _store(s3_env, bucket).check_access()  # credentials come from the env through the AWS chain


def test_reupload_withdraws_the_old_marker_before_replacing_files(s3_env, bucket, make_checkpoint, tmp_path):
    store = _store(s3_env, bucket)
    old = make_checkpoint(tmp_path / "old", 100)
    store.upload_checkpoint(old, hash_checkpoint(old))
    new = make_checkpoint(tmp_path / "new", 100)  # same step saved again after a resume
    complete_while_writing = []
    store.client.meta.events.register(
        "before-call.s3.PutObject", lambda **_: complete_while_writing.append(store.list_checkpoints()[0])
    )

    store.upload_checkpoint(new, hash_checkpoint(new))

    assert complete_while_writing[0] == []  # no reader could trust the old marker meanwhile
    got = resolve_resume(f"s3://{bucket}/runs/a", tmp_path / "resume", endpoint_url=s3_env.endpoint)
    assert _files(got) == _files(new)
