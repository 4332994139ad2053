"""Atomic local checkpoints: drafter weights + optimizer + scheduler + RNG + data cursor + config.

Layout: <run_dir>/checkpoints/step_00000100/
  model.safetensors   drafter only (export tensor names, docs/design.md#export-format; never embed_tokens / lm_head)
  draft_config.json   enough to rebuild the drafter without the run config
  optimizer.pt        optimizer + scheduler state
  trainer_state.json  step, data cursor, RNG states, target identity, config
  integrity.json      every other file's size and sha256, written last (checkpoint/integrity.py)
A checkpoint is written into a hidden temp dir, fsynced, then renamed: a crash at any moment
leaves either the previous checkpoints or a complete new one, never a half-written one.
Saving is two halves: `snapshot` copies the state to CPU (training waits for this only), then
`write_checkpoint` does the disk I/O, which `CheckpointWriter` runs in a background thread: an 8B
target's 5-layer drafter with AdamW is 11.7 GiB and took ~19 s to write with every rank stalled.
"""

from __future__ import annotations

import base64
import json
import random
import re
import shutil
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dflash_train.atomic import swap_dir
from dflash_train.checkpoint.integrity import CheckpointError, write_record
from dflash_train.disk import DiskError, writes_to

STEP_DIR = re.compile(r"step_(\d{8})")


def step_dir_name(step: int) -> str:
    """The one spelling of a checkpoint's name, local and remote: `step_00000100`."""
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """`step_00000100` -> 100; anything else (temp dirs, stray files) -> None."""
    m = STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / step_dir_name(step)


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and step_of(p.name) is not None)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": [v.tolist() if isinstance(v, np.ndarray) else v for v in np.random.get_state()],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.asarray(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        )


def _to_cpu(obj):
    """A CPU copy of every tensor in a state tree (a CPU tensor is cloned too: the optimizer keeps
    updating its own in place), and copies of the containers around them."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True).contiguous()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def snapshot(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, trainer_state: dict,
             extra_files: dict[str, str] | None = None) -> dict:
    """Everything one checkpoint holds, on CPU and detached from training."""
    return {
        "weights": _to_cpu(drafter.state_dict()),
        "draft_config": drafter.config.to_dict(),
        "optim": _to_cpu({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}),
        "state": dict(trainer_state, rng=rng_state()),
        "extra_files": dict(extra_files or {}),
    }


def write_checkpoint(run_dir: str | Path, step: int, snap: dict) -> Path:
    """Write `snap` as checkpoint `step`; on any failure (a full disk) its temp dir is removed and
    the checkpoints already there are untouched."""
    root = checkpoints_dir(run_dir)
    final = checkpoint_path(run_dir, step)
    tmp = root / f".tmp_{final.name}"
    with writes_to(final):
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp_step_*"):  # a killed write's: one writer per run, so none is live
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        try:
            save_file(snap["weights"], tmp / "model.safetensors", metadata={"format": "pt"})
            (tmp / "draft_config.json").write_text(json.dumps(snap["draft_config"], indent=2))
            with open(tmp / "optimizer.pt", "wb") as f:  # a full disk then shows as the OSError it is
                torch.save(snap["optim"], f)
            (tmp / "trainer_state.json").write_text(json.dumps(dict(snap["state"], step=step), indent=2, default=str))
            for name, text in snap["extra_files"].items():
                (tmp / name).write_text(text)
            write_record(tmp)  # last: a checkpoint under its final name always has its record
            return swap_dir(tmp, final)  # re-saving a step (final == periodic) replaces it atomically
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


class CheckpointWriter:
    """Runs one write at a time in a background thread; `submit` first waits for the previous one,
    so at most one CPU snapshot is held. A failed write is raised by the next `submit` or `wait`.
    The thread is not a daemon: a training error still lets the write in flight finish."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], object]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(write,), name="dflash-checkpoint-writer")
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, DiskError):  # already one line naming the path
                message = f"writing a checkpoint failed: {error}; the checkpoints before it are intact"
                raise DiskError(message) from error
            raise RuntimeError(f"writing a checkpoint failed: {error}") from error

    def _run(self, write: Callable[[], object]) -> None:
        try:
            write()
        except BaseException as err:  # handed to the training thread
            self._error = err


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no trainer_state.json)")
    return {
        "path": path,
        "model": read_checkpoint_file(path / "model.safetensors", lambda f: load_file(f, device=str(map_location))),
        "draft_config": read_checkpoint_file(path / "draft_config.json", lambda f: json.loads(f.read_text())),
        "optim": read_checkpoint_file(path / "optimizer.pt",
                                      lambda f: torch.load(f, map_location=map_location, weights_only=False)),
        "state": read_checkpoint_file(path / "trainer_state.json", lambda f: json.loads(f.read_text())),
    }


def read_checkpoint_file(file: Path, read: Callable[[Path], object]):
    """One checkpoint file; a missing, truncated or corrupt one is one line naming it (safetensors,
    pickle and json each fail in their own way, all of them as tracebacks)."""
    try:
        return read(file)
    except Exception as err:  # noqa: BLE001 -- any failure to read the file is the same user-facing problem
        first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        raise CheckpointError(f"{file}: unreadable checkpoint file ({type(err).__name__}: {first[:200]})") from err


def check_resume_compatible(saved: dict, current: dict) -> None:
    """Refuse to resume when what defines the drafter's task changed."""
    problems = [
        f"  {key}: checkpoint has {saved.get(key)!r}, config now has {current[key]!r}"
        for key in current
        if saved.get(key) != current[key]
    ]
    if problems:
        raise ValueError("cannot resume: the checkpoint was trained for a different setup:\n" + "\n".join(problems))
