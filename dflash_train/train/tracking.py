"""Experiment tracking: wandb or TensorBoard, besides the metrics.jsonl the trainer always writes.

- Metric dicts may hold lists (per-position accuracy `acc: [a1, ..., a15]`) and nested dicts; both
  are flattened to scalar keys `acc/1 ... acc/15`, `eval/tau`, so every backend can plot them.
- wandb runs offline unless WANDB_API_KEY is set or WANDB_MODE says otherwise, so a run without an
  account never blocks on a login prompt; `start` returns the run id to store in the checkpoint and,
  given it back on resume, continues the same run.
- Configs and manifests are scrubbed of secrets before they leave the process.
"""

from __future__ import annotations

import json
import os
import re
from numbers import Number
from pathlib import Path
from typing import Any

from dflash_train.config_training import TrackingConfig

REDACTED = "<redacted>"
_SECRET_WORDS = ("secret", "password", "passwd", "api_key", "apikey", "access_key", "credential")
_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def _is_secret_key(key: str) -> bool:
    k = key.lower()
    # 'token' only as the last word: hf_token / auth_token are secrets, token_budget and
    # mask_token_id are config.
    return any(w in k for w in _SECRET_WORDS) or re.split(r"[^a-z0-9]+", k)[-1] == "token"


def scrub(value: Any) -> Any:
    """Copy of `value` with secret-named keys redacted and user:password@ removed from URLs."""
    if isinstance(value, dict):
        return {k: REDACTED if _is_secret_key(str(k)) else scrub(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v) for v in value]
    if isinstance(value, str):
        return _URL_USERINFO.sub(f"{REDACTED}@", value)
    return value


def flatten_metrics(metrics: dict, prefix: str = "") -> dict[str, float]:
    """{'loss': 1.0, 'acc': [.9, .8], 'eval': {'tau': 3.1}} -> loss, acc/1, acc/2, eval/tau.
    Lists are numbered from 1: position k of a block (slot 0 carries no prediction)."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_metrics(value, f"{name}/"))
        elif isinstance(value, (list, tuple)):
            flat.update(flatten_metrics({str(i): v for i, v in enumerate(value, start=1)}, f"{name}/"))
        elif hasattr(value, "item"):  # 0-d tensors and numpy scalars
            flat[name] = float(value.item())
        elif isinstance(value, Number):
            flat[name] = float(value)
    return flat


class _NoBackend:
    def __init__(self, cfg: TrackingConfig):
        pass

    def start(self, run_dir: Path, config: dict, manifest: dict | None, run_id: str | None) -> str | None:
        return run_id

    def log(self, metrics: dict, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class _WandbBackend:
    def __init__(self, cfg: TrackingConfig):
        try:
            import wandb
        except ImportError:
            raise ImportError(
                "tracking.backend=wandb needs wandb: pip install 'dflash-train[wandb]'"
            ) from None
        self.wandb = wandb
        self.cfg = cfg
        self.run = None

    def start(self, run_dir, config, manifest, run_id):
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = self.wandb.init(
            project=self.cfg.project,
            name=self.cfg.run_name,
            dir=str(run_dir),
            id=run_id,
            resume="allow" if run_id else None,
            mode=mode,
            config={**config, "manifest": manifest} if manifest is not None else config,
        )
        return self.run.id

    def log(self, metrics, step):
        self.run.log(flatten_metrics(metrics), step=step)
        # The latest per-position curve as one list too (a table per step would pile up files).
        for key, value in metrics.items():
            if isinstance(value, (list, tuple)):
                self.run.summary[key] = [float(v) for v in value]

    def finish(self):
        self.run.finish()


class _TensorBoardBackend:
    def __init__(self, cfg: TrackingConfig):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "tracking.backend=tensorboard needs tensorboard: pip install 'dflash-train[tensorboard]'"
            ) from None
        self.writer_cls = SummaryWriter
        self.writer = None

    def start(self, run_dir, config, manifest, run_id):
        # Resume appends a new events file to the same directory; TensorBoard merges them.
        self.writer = self.writer_cls(log_dir=str(Path(run_dir) / "tensorboard"))
        self.writer.add_text("config", f"```\n{json.dumps(config, indent=1, default=str)}\n```")
        if manifest is not None:
            self.writer.add_text("manifest", f"```\n{json.dumps(manifest, indent=1, default=str)}\n```")
        return run_id

    def log(self, metrics, step):
        for key, value in flatten_metrics(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)

    def finish(self):
        self.writer.close()


_BACKENDS = {"none": _NoBackend, "wandb": _WandbBackend, "tensorboard": _TensorBoardBackend}


class Tracker:
    """start -> log ... -> finish. One per run, on the rank that logs (rank 0)."""

    def __init__(self, cfg: TrackingConfig):
        self.backend = _BACKENDS[cfg.backend](cfg)

    def start(
        self, run_dir: str | Path, config: dict, manifest: dict | None = None, run_id: str | None = None
    ) -> str | None:
        """Returns the id to store in checkpoints (None for backends without run identity); pass it
        back on resume to continue the same run."""
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        return self.backend.start(
            Path(run_dir), scrub(config), None if manifest is None else scrub(manifest), run_id
        )

    def log(self, metrics: dict, step: int) -> None:
        self.backend.log(metrics, step)

    def finish(self) -> None:
        self.backend.finish()
