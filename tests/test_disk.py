"""Faults of the disk: a read-only location fails before any expensive work, a full disk in one line
naming the file, with no temp files left and the earlier checkpoints intact. The faults are injected
(an OSError with the real errno where the kernel would raise it): the tests run as any user."""

from __future__ import annotations

import errno
import json
import tempfile
from pathlib import Path

import pytest
import yaml

from dflash_train.checkpoint import local as ckpt
from dflash_train.cli import main
from dflash_train.disk import DiskError, as_disk_error, require_writable
from dflash_train.train.loop import Trainer
from dflash_train.train.metrics import MetricsFile, read_metrics

CONVERSATION = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}


@pytest.fixture
def read_only(monkeypatch):
    """read_only(dir): creating a file under `dir` fails as on a read-only mount."""
    roots: list[Path] = []
    mkstemp = tempfile.mkstemp

    def refusing(*args, dir=None, **kwargs):
        if dir is not None and any(Path(dir).absolute().is_relative_to(r) for r in roots):
            raise OSError(errno.EROFS, "Read-only file system", str(Path(dir) / "x"))
        return mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refusing)
    return lambda root: roots.append(Path(root).absolute())


def _one_line(capsys, code: int, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_require_writable_probes_without_leaving_anything(tmp_path, read_only):
    require_writable(tmp_path / "new" / "run", "the run")  # a missing dir: its parent is probed
    assert list(tmp_path.iterdir()) == []  # not created, no probe file left
    read_only(tmp_path / "mnt")
    (tmp_path / "mnt").mkdir()
    with pytest.raises(DiskError, match=f"{tmp_path}/mnt/run: cannot write the run: read-only file system "
                                         f"\\(it would be created in {tmp_path}/mnt\\)"):
        require_writable(tmp_path / "mnt" / "run", "the run")
    (tmp_path / "file").write_text("x")
    with pytest.raises(DiskError, match="file/run: cannot write the run: not a directory"):
        require_writable(tmp_path / "file" / "run", "the run")


def test_a_full_disk_is_found_under_the_errors_libraries_raise(tmp_path):
    def torch_save_on_a_full_disk():  # torch.save on a real file: its own error, the file's OSError inside
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None

    with pytest.raises(RuntimeError) as caught:
        torch_save_on_a_full_disk()
    assert caught.value.__cause__ is None  # found through __context__, which `from None` keeps
    assert str(as_disk_error(caught.value, tmp_path / "x.pt")) == f"{tmp_path}/x.pt: no space left on device"
    rust = Exception("Error while serializing: I/O error: No space left on device (os error 28)")  # safetensors
    assert str(as_disk_error(rust, "m.safetensors")) == "m.safetensors: no space left on device"
    assert as_disk_error(RuntimeError("no such file (os error 2)")) is None  # ENOENT is not a disk fault
    assert as_disk_error(ValueError("bad value")) is None


def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one(make_run_config, shared_tiny_target, monkeypatch):
    save_file = ckpt.save_file
    calls = []

    def filling_up(tensors, path, **kwargs):  # the second checkpoint's weights do not fit
        calls.append(path)
        if len(calls) == 2:
            Path(path).write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        save_file(tensors, path, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", filling_up)
    trainer = Trainer(make_run_config(overrides=["train.max_steps=4"]), target=shared_tiny_target)
    for _ in range(2):  # the second save fails in the background writer, and says so on the next wait
        trainer.train_step()
        trainer.checkpointer.save(trainer.progress)
    with pytest.raises(DiskError, match="writing a checkpoint failed: .*step_00000002.*no space left on device; "
                                        "the checkpoints before it are intact"):
        trainer.checkpointer.writer.wait()
    root = ckpt.checkpoints_dir(trainer.cfg.run_dir)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]  # no .tmp_step_00000002
    assert ckpt.load_checkpoint(root / "step_00000001")["state"]["step"] == 1


def test_a_killed_writes_temp_dir_is_removed_by_the_next_save(make_run_config, shared_tiny_target):
    trainer = Trainer(make_run_config(overrides=["train.max_steps=2"]), target=shared_tiny_target)
    root = ckpt.checkpoints_dir(trainer.cfg.run_dir)
    (root / ".tmp_step_00000007").mkdir(parents=True)  # a write killed at step 7 of an earlier process
    trainer.train_step()
    trainer.checkpointer.save(trainer.progress, wait=True)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]


def test_metrics_on_a_filling_disk_name_the_file_and_a_cut_line_is_dropped(tmp_path):
    metrics = MetricsFile(tmp_path)
    metrics.write({"step": 1, "loss": 2.0})

    class NearlyFull:  # takes the first 5 bytes, then has no space left
        def __init__(self, f):
            self.f = f

        def write(self, data):
            if self.f.tell() > 30:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data[:5])

    metrics._f = NearlyFull(metrics._f)
    with pytest.raises(DiskError, match=f"{tmp_path}/metrics.jsonl: no space left on device"):
        metrics.write({"step": 2, "loss": 1.0})
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1  # and a cut second line
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]  # a reader meanwhile sees only the whole one
    MetricsFile(tmp_path, resume_step=1).close()  # the resumed run drops the cut line
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]


def _run_config(tmp_path: Path, run_dir: Path) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(CONVERSATION) + "\n")
    cfg = {"run_dir": str(run_dir), "device": "cpu", "target": {"path": "smollm2"},
           "draft": {"num_layers": 1, "target_layer_ids": [0, 1], "attention": "sdpa"},
           "objective": {"block_size": 4, "mask_token_id": 0},
           "data": {"train_files": [str(data)], "max_length": 64, "token_budget": 128}, "train": {"max_steps": 1}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_read_only_locations_fail_in_one_line_before_any_loading(tmp_path, read_only, monkeypatch, capsys):
    import dflash_train.targets.model as target
    import dflash_train.targets.tokenizer as tokenizer
    import dflash_train.train.inputs as inputs

    never = lambda *a, **k: pytest.fail("a model loaded before the write check")  # noqa: E731
    monkeypatch.setattr(inputs, "load_target", never)
    monkeypatch.setattr(target, "resolve_target_path", never)
    monkeypatch.setattr(tokenizer, "resolve_target_path", never)  # prepare's
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    read_only(mnt)
    cfg = _run_config(tmp_path, mnt / "run")
    _one_line(capsys, main(["train", "-c", str(cfg)]), f"{mnt}/run: cannot write the run's checkpoints",
              "read-only file system")
    _one_line(capsys, main(["prepare", "-c", str(cfg), "--out", str(mnt / "prepared")]),
              f"{mnt}/prepared: cannot write the prepared dataset: read-only file system")
    _one_line(capsys, main(["generate", "--input", str(tmp_path / "train.jsonl"), "--out", str(mnt / "answers"),
                            "--server-url", "http://127.0.0.1:9"]),
              f"{mnt}/answers: cannot write generate's output: read-only file system")
    _one_line(capsys, main(["export", str(tmp_path / "ckpt"), str(mnt / "export")]),
              f"{mnt}: cannot write the export {mnt}/export: read-only file system")
    assert list(mnt.iterdir()) == []


def test_an_unchecked_writer_on_a_full_disk_is_one_line(monkeypatch, capsys):
    import dflash_train.eval.export as export

    def full(*args, **kwargs):
        raise RuntimeError("serialising failed") from OSError(errno.ENOSPC, "No space left on device", "out/w.bin")

    monkeypatch.setattr(export, "export_drafter", full)
    _one_line(capsys, main(["export", "ckpt", "out"]), "error: out/w.bin: no space left on device")
