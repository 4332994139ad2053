"""`dflash-train capture`: features written once, training from them equals training online."""

from __future__ import annotations

import json

import pytest

from dflash_train.train.capture import MANIFEST, capture
from dflash_train.train.loop import Trainer


def test_training_from_captured_features_equals_training_online(make_run_config, shared_tiny_target, tmp_path,
                                                                monkeypatch):
    over = ["train.epochs=2"]
    plain = Trainer(make_run_config("plain", over), target=shared_tiny_target)
    monkeypatch.setattr("dflash_train.train.inputs.load_target", lambda *a, **k: shared_tiny_target)
    manifest = capture(make_run_config("c", over), tmp_path / "cap", rows_per_shard=5)
    assert len(manifest["shards"]) > 2 and manifest["fingerprint"]["rows"] == len(plain.parts.dataset)

    captured = Trainer(make_run_config("captured", [*over, f"data.captured_features={tmp_path / 'cap'}"]),
                       target=shared_tiny_target)
    for _ in range(plain.progress.total_steps):
        with monkeypatch.context() as m:
            m.setattr(shared_tiny_target, "features", lambda *a: pytest.fail("the target ran on captured data"))
            loss = float(captured.train_step()["loss"])
        assert loss == pytest.approx(float(plain.train_step()["loss"]), rel=1e-6)


def test_captured_features_kept_in_memory_are_read_once_and_train_the_same(make_run_config, shared_tiny_target,
                                                                            tmp_path, monkeypatch):
    """data.captured_features + data.cache_features: each row is read from the capture's shards once
    (its first batch), later epochs from memory; the target never runs; the losses equal online
    training's. Bucketed, so batches carry padding rows and length."""
    over = ["train.epochs=3", "data.length_bucket=32"]
    plain = Trainer(make_run_config("plain", over), target=shared_tiny_target)
    monkeypatch.setattr("dflash_train.train.inputs.load_target", lambda *a, **k: shared_tiny_target)
    capture(make_run_config("c", over), tmp_path / "cap", rows_per_shard=5)
    kept = Trainer(make_run_config("kept", [*over, f"data.captured_features={tmp_path / 'cap'}",
                                            "data.cache_features=true"]), target=shared_tiny_target)
    expected = [float(plain.train_step()["loss"]) for _ in range(plain.progress.total_steps)]
    reads = []
    real_row = kept.parts.features.captured.row
    monkeypatch.setattr(kept.parts.features.captured, "row", lambda i: reads.append(i) or real_row(i))
    monkeypatch.setattr(shared_tiny_target, "features", lambda *a: pytest.fail("the target ran on captured data"))
    assert [float(kept.train_step()["loss"]) for _ in range(kept.progress.total_steps)] == pytest.approx(expected, rel=1e-6)
    assert sorted(reads) == list(range(len(kept.parts.dataset)))  # every row read once over three epochs


def test_an_interrupted_capture_resumes_and_a_foreign_one_is_refused(make_run_config, shared_tiny_target,
                                                                      tmp_path, monkeypatch):
    monkeypatch.setattr("dflash_train.train.inputs.load_target", lambda *a, **k: shared_tiny_target)
    cfg = make_run_config("c")
    out = tmp_path / "cap"
    full = capture(cfg, out, rows_per_shard=5)
    manifest = json.loads((out / MANIFEST).read_text())
    lost = manifest["shards"].pop()  # as if the run died before the last shard was listed
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="rows captured"):
        Trainer(make_run_config("t", [f"data.captured_features={out}"]), target=shared_tiny_target)
    written = []
    monkeypatch.setattr("dflash_train.train.capture.write_atomic",
                        lambda path, write, real=__import__("dflash_train.atomic").atomic.write_atomic:
                        written.append(path.name) or real(path, write))
    assert capture(cfg, out, rows_per_shard=5)["shards"] == full["shards"]
    assert written == [lost["file"], MANIFEST]  # only the missing shard was computed again
    with pytest.raises(ValueError, match="captured with another layer_ids"):
        Trainer(make_run_config("t2", [f"data.captured_features={out}", "draft.target_layer_ids=[1]"]),
                target=shared_tiny_target)
