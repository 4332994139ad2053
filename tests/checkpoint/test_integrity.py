"""A checkpoint's integrity record: damaged files are found and named, `--resume auto` moves a
corrupt newest checkpoint aside and carries on from the one before it exactly, and `eval`/`export`
refuse a corrupt checkpoint in one line."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from dflash_train.checkpoint import local as ckpt
from dflash_train.checkpoint.integrity import (
    RECORD, CheckpointError, find_fault, hash_checkpoint, require_intact, sha256_file,
)
from dflash_train.checkpoint.storage import checkpoint_to_resume, download_checkpoint, has_receipt, newest_intact, write_receipt
from dflash_train.cli import main
from dflash_train.eval.export import export_drafter
from dflash_train.train.loop import Trainer, train
from dflash_train.train.metrics import read_metrics


def _cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _interrupt_record(path: Path) -> None:  # the record's own write cut short
    path.write_text(path.read_text()[:40])


def _finished_run(make_run_config, target):
    """A 2-step run checkpointed at both steps, and each step's (loss, lr, grad norm). Steps and
    saves are called directly: `fit` would add its manifest's second of package scanning."""
    cfg = make_run_config("run", ["train.max_steps=2", "checkpoint.every=1"])
    trainer, records = Trainer(cfg, target=target), {}
    for step in (1, 2):
        out = trainer.train_step()
        records[step] = (float(out["loss"]), out["lr"], float(out["grad_norm"]))
        trainer.checkpointer.save(trainer.progress, wait=True)
    return cfg, records


def test_the_record_lists_every_file_with_its_real_hash(make_run_config, shared_tiny_target):
    cfg, _ = _finished_run(make_run_config, shared_tiny_target)
    path = ckpt.latest_checkpoint(cfg.run_dir)
    record = json.loads((path / RECORD).read_text())
    files = sorted(p.name for p in path.iterdir() if p.name != RECORD)
    assert [e["name"] for e in record["files"]] == files
    for e in record["files"]:
        assert (e["size"], e["sha256"]) == ((path / e["name"]).stat().st_size, sha256_file(path / e["name"]))
    assert require_intact(path) is True and find_fault(path) is None
    (path / "trainer_state.json").unlink()
    assert find_fault(path) == "trainer_state.json: missing"


@pytest.mark.parametrize("damage,file,fault", [
    (_cut_in_half, "model.safetensors", r"model.safetensors: [\d,]+ bytes, its integrity record says [\d,]+"),
    (_flip_a_bit, "optimizer.pt", "optimizer.pt: contents differ from its integrity record"),
    (_interrupt_record, RECORD, f"{RECORD}: unreadable"),
], ids=["truncated", "bit-flipped", "interrupted-record"])
def test_resume_auto_moves_a_corrupt_newest_checkpoint_aside_and_continues_exactly(
        make_run_config, shared_tiny_target, caplog, damage, file, fault):
    cfg, straight = _finished_run(make_run_config, shared_tiny_target)
    newest = ckpt.checkpoint_path(cfg.run_dir, 2)
    write_receipt(newest, "s3://bucket/run/step_00000002")
    damage(newest / file)
    with pytest.raises(CheckpointError, match=fault):
        require_intact(newest)

    with caplog.at_level(logging.WARNING):
        summary = train(cfg, resume="auto", target=shared_tiny_target, progress=False)
    warning = next(r.getMessage() for r in caplog.records if "moved aside" in r.getMessage())
    assert f"{newest}: corrupt checkpoint: " in warning and "step_00000002.corrupt" in warning
    aside = newest.with_name("step_00000002.corrupt")
    assert aside.is_dir() and has_receipt(aside) and not has_receipt(newest)  # kept, receipt with it
    # Resumed from step 1: step 2 again, equal to the uninterrupted run's, and a good step 2.
    assert summary["steps"] == 2
    again = {r["step"]: (r["loss"], r["lr"], r["grad_norm"]) for r in read_metrics(cfg.run_dir)}
    assert again == {2: straight[2]}
    assert require_intact(newest) is True


def test_resume_auto_skips_every_corrupt_checkpoint_and_never_deletes_one(make_run_config, shared_tiny_target):
    cfg, _ = _finished_run(make_run_config, shared_tiny_target)
    for step in (1, 2):
        _cut_in_half(ckpt.checkpoint_path(cfg.run_dir, step) / "model.safetensors")
    ckpt.checkpoint_path(cfg.run_dir, 2).with_name("step_00000002.corrupt").mkdir()  # an earlier one
    assert newest_intact(cfg.run_dir) is None
    names = sorted(p.name for p in ckpt.checkpoints_dir(cfg.run_dir).iterdir())
    assert names == ["step_00000001.corrupt", "step_00000002.corrupt", "step_00000002.corrupt-1"]


def test_a_checkpoint_without_a_record_still_resumes_with_a_warning(make_run_config, shared_tiny_target, caplog):
    cfg, _ = _finished_run(make_run_config, shared_tiny_target)
    newest = ckpt.checkpoint_path(cfg.run_dir, 2)
    (newest / RECORD).unlink()  # as written before checkpoints had records
    with caplog.at_level(logging.WARNING):
        assert newest_intact(cfg.run_dir) == newest
    assert "has no integrity record" in caplog.text and "unverified" in caplog.text


def test_resume_at_a_folder_that_is_no_checkpoint_says_so(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"--resume .*/run: not a checkpoint \(no trainer_state.json\); "
                                              "a run directory: --resume auto takes"):
        checkpoint_to_resume(str(tmp_path / "run"), tmp_path / "run")
    with pytest.raises(CheckpointError, match="/nowhere: no such directory; give a checkpoints/step_NNNNNNNN folder"):
        checkpoint_to_resume(str(tmp_path / "nowhere"), tmp_path / "run")


def test_a_corrupt_checkpoint_chosen_by_hand_fails_before_the_target_loads(make_run_config, monkeypatch,
                                                                             shared_tiny_target):
    import dflash_train.train.inputs as inputs

    cfg, _ = _finished_run(make_run_config, shared_tiny_target)
    newest = ckpt.checkpoint_path(cfg.run_dir, 2)
    _flip_a_bit(newest / "model.safetensors")
    monkeypatch.setattr(inputs, "load_target", lambda *a: pytest.fail("the target loaded before the check"))
    with pytest.raises(CheckpointError, match=f"{newest}: corrupt checkpoint: model.safetensors: contents differ"):
        train(cfg, resume=str(newest), progress=False)
    assert newest.is_dir()  # a checkpoint named by hand is never moved


def _eval_config(tmp_path: Path, run_dir: str) -> Path:
    cfg = {"run_dir": run_dir, "device": "cpu", "target": {"path": "smollm2"}, "draft": {"num_layers": 1}}
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_eval_and_export_of_a_corrupt_checkpoint_are_one_line(make_run_config, shared_tiny_target, tmp_path,
                                                               monkeypatch, capsys):
    import dflash_train.eval.report as report

    cfg, _ = _finished_run(make_run_config, shared_tiny_target)
    newest = ckpt.checkpoint_path(cfg.run_dir, 2)
    export_drafter(newest, tmp_path / "good")  # intact: exports
    _cut_in_half(newest / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{newest}: corrupt checkpoint: model.safetensors: "):
        export_drafter(newest, tmp_path / "export")
    assert not (tmp_path / "export").exists()

    monkeypatch.setattr(report, "load_target", lambda *a: shared_tiny_target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    for argv in (["export", str(newest), str(tmp_path / "export")],
                 ["eval", "-c", str(_eval_config(tmp_path, cfg.run_dir)), "--prompts", str(prompts)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and err.startswith(f"error: {newest}: corrupt checkpoint: model.safetensors")
        assert len(err.splitlines()) == 1, err

    (newest / RECORD).unlink()  # no record: the damage is still one line, from the file itself
    with pytest.raises(CheckpointError, match=f"{newest}/model.safetensors: unreadable checkpoint file"):
        export_drafter(newest, tmp_path / "export")


def test_a_checkpoint_copied_somewhere_else_still_verifies(make_run_config, shared_tiny_target, tmp_path):
    cfg, _ = _finished_run(make_run_config, shared_tiny_target)
    copy = shutil.copytree(ckpt.checkpoint_path(cfg.run_dir, 2), tmp_path / "elsewhere")
    assert require_intact(copy) is True  # names are relative: the record travels with the files


class CopiedStore:
    """The part of S3Store a restore uses, over a local folder: what was uploaded, and its marker."""

    def __init__(self, root: Path):
        self.root = root

    def where(self, name: str = "") -> str:
        return f"s3://bucket/run/{name}"

    def upload(self, ckpt_dir: Path) -> None:
        shutil.copytree(ckpt_dir, self.root / ckpt_dir.name)
        self.marker = hash_checkpoint(ckpt_dir)  # hashes what is uploaded, as the uploader does

    def read_marker(self, name: str):
        return self.marker

    def download_checkpoint(self, name: str, entries, dest: Path) -> None:
        shutil.copytree(self.root / name, dest, dirs_exist_ok=True)


def test_a_checkpoint_damaged_before_its_upload_is_refused_on_restore(make_run_config, shared_tiny_target,
                                                                        tmp_path):
    """The commit marker vouches for the upload, the record for the checkpoint as written: a file
    damaged on the local disk before its upload passes the marker, and only the record tells."""
    cfg, _ = _finished_run(make_run_config, shared_tiny_target)
    newest = ckpt.checkpoint_path(cfg.run_dir, 2)
    _flip_a_bit(newest / "model.safetensors")
    store = CopiedStore(tmp_path / "bucket")
    store.upload(newest)
    with pytest.raises(CheckpointError, match=r"s3://bucket/run/step_00000002: corrupt checkpoint \(damaged before "
                                              r"its upload\): model.safetensors: contents differ"):
        download_checkpoint(store, newest.name, tmp_path / "restore")
    assert list((tmp_path / "restore").iterdir()) == []  # nothing half-restored left behind
