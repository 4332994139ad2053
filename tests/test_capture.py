"""`dflash-train capture`: features written once, training from them equals training online."""

from __future__ import annotations

import json

import pytest

from dflash_train.capture import MANIFEST, capture
from dflash_train.train.loop import Trainer


def test_training_from_captured_features_equals_training_online(make_run_config, shared_tiny_target, tmp_path,
                                                                monkeypatch):
    over = ["train.epochs=2"]
    plain = Trainer(make_run_config("plain", over), target=shared_tiny_target)
    monkeypatch.setattr("dflash_train.train.parts.load_target", lambda *a, **k: shared_tiny_target)
    manifest = capture(make_run_config("c", over), tmp_path / "cap", rows_per_shard=5)
    assert len(manifest["shards"]) > 2 and manifest["fingerprint"]["rows"] == len(plain.dataset)

    captured = Trainer(make_run_config("captured", [*over, f"data.captured_features={tmp_path / 'cap'}"]),
                       target=shared_tiny_target)
    for _ in range(plain.total_steps):
        with monkeypatch.context() as m:
            m.setattr(shared_tiny_target, "features", lambda *a: pytest.fail("the target ran on captured data"))
            loss = float(captured.train_step()["loss"])
        assert loss == pytest.approx(float(plain.train_step()["loss"]), rel=1e-6)


def test_an_interrupted_capture_resumes_and_a_foreign_one_is_refused(make_run_config, shared_tiny_target,
                                                                      tmp_path, monkeypatch):
    monkeypatch.setattr("dflash_train.train.parts.load_target", lambda *a, **k: shared_tiny_target)
    cfg = make_run_config("c")
    out = tmp_path / "cap"
    full = capture(cfg, out, rows_per_shard=5)
    manifest = json.loads((out / MANIFEST).read_text())
    lost = manifest["shards"].pop()  # as if the run died before the last shard was listed
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="rows captured"):
        Trainer(make_run_config("t", [f"data.captured_features={out}"]), target=shared_tiny_target)
    written = []
    monkeypatch.setattr("dflash_train.capture.write_atomic",
                        lambda path, write, real=__import__("dflash_train.atomic").atomic.write_atomic:
                        written.append(path.name) or real(path, write))
    assert capture(cfg, out, rows_per_shard=5)["shards"] == full["shards"]
    assert written == [lost["file"], MANIFEST]  # only the missing shard was computed again
    with pytest.raises(ValueError, match="captured with another layer_ids"):
        Trainer(make_run_config("t2", [f"data.captured_features={out}", "draft.target_layer_ids=[1]"]),
                target=shared_tiny_target)
