"""A run's checkpoints: the files that describe the run, a save every `checkpoint.every` steps and
at the end, uploads and pruning after each save, and resuming from one.

With checkpoint.background the disk write (and the upload and pruning after it) runs while
training goes on; one snapshot is held in memory at a time.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import yaml

from dflash_train.checkpoint import local as ckpt
from dflash_train.checkpoint.storage import prune_local
from dflash_train.checks.manifest import build_manifest, write_manifest
from dflash_train.config import RunConfig, dump_config
from dflash_train.train.build import RunParts
from dflash_train.train.optim import refit_scheduler, retarget_scheduler
from dflash_train.train.progress import Progress

log = logging.getLogger("dflash_train")


class Checkpointer:
    def __init__(self, cfg: RunConfig, parts: RunParts):
        self.cfg, self.parts = cfg, parts
        self.run_dir = Path(cfg.run_dir)
        self.manifest: dict | None = None  # written when training starts; checkpoints carry it
        self.uploader = None  # background uploads to checkpoint.remote
        if cfg.checkpoint.remote:
            from dflash_train.checkpoint.uploader import remote_uploader  # boto3 only when asked for

            self.uploader = remote_uploader(cfg.checkpoint)
        self.writer = ckpt.CheckpointWriter()

    def start(self) -> dict:
        """The run directory's config.yaml and manifest.json (which every checkpoint also carries);
        returns the manifest."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
        self.manifest = build_manifest(self.cfg.model_dump(mode="json"), sys.argv, self.run_dir,
                                       target=self.parts.target.description)
        write_manifest(self.run_dir, self.manifest)
        return self.manifest

    def compatibility(self) -> dict:
        d = self.parts.drafter.config
        return {
            "block_size": d.block_size,
            "target_layer_ids": d.target_layer_ids,
            "num_draft_layers": d.num_hidden_layers,
            "mask_token_id": d.mask_token_id,
            "target": self.parts.target.identity,
        }

    def check_weighting_kept(self, saved_config: Path) -> None:
        """Refuse to resume where a default that changed (2026-12-07: slot weights decay -> dpace, the
        selector's join -> skip) would change the loss of a run saved before: the checkpoint's
        config.yaml names what it trained with."""
        if not saved_config.is_file():
            return
        tree = ckpt.read_checkpoint_file(saved_config, lambda f: yaml.safe_load(f.read_text()))  # one line if corrupt
        saved = (tree or {}).get("objective") or {}
        keys = ["slot_weights"] + (["selector_outside_top_k"] if self.cfg.objective.loss.get("selector", 0) > 0 else [])
        for key in keys:
            now = getattr(self.cfg.objective, key)
            if key in saved and saved[key] != now:
                raise ValueError(f"cannot resume from {saved_config.parent}: it trained with objective.{key}={saved[key]}, "
                                 f"the config now gives {now}: set objective.{key}={saved[key]} to go on as it trained")

    def resume(self, path: str | Path, progress: Progress) -> None:
        """The drafter, optimizer, schedule, RNG states and `progress` as saved at `path`."""
        p, tc = self.parts, self.cfg.train
        saved = ckpt.load_checkpoint(path, map_location=p.device)
        state = saved["state"]
        ckpt.check_resume_compatible(state["compatibility"], self.compatibility())
        self.check_weighting_kept(Path(path) / "config.yaml")
        p.drafter.load_state_dict(saved["model"])
        p.optimizer.load_state_dict(saved["optim"]["optimizer"])
        p.scheduler.load_state_dict(saved["optim"]["scheduler"])
        # The schedule follows THIS run's length (train.max_steps may have been raised to train on):
        # same config -> the same rates as saved; a longer run -> the longer cosine, no jump.
        if tc.time_budget_minutes and state.get("total_steps"):
            # A budgeted run's saved length is its ceiling: refitting from the full plan would push the
            # rate back up at every resume; this call's budget can only shorten it further. Its saved
            # schedule (refitted as it went) continues from the saved step.
            progress.total_steps = min(progress.total_steps, state["total_steps"])
        if tc.time_budget_minutes and saved["optim"]["scheduler"]["lr_lambdas"][0] is not None:
            saved_schedule = p.scheduler.lr_lambdas[0]
            changed = [k for k in ("warmup_ratio", "min_lr_ratio", "schedule", "decay_ratio")
                       if getattr(saved_schedule, k) != getattr(tc, k)]
            if changed:
                log.warning("resume: the budgeted run continues its saved schedule; train.%s changed in the "
                            "config apply to new runs only", ", train.".join(changed))
            refit_scheduler(p.scheduler, progress.total_steps)
        else:  # a fixed-length run, or a checkpoint from before schedules were saved: the plain schedule
            retarget_scheduler(p.scheduler, tc, progress.total_steps)
        progress.step = state["step"]
        progress.cursor = tuple(state["cursor"])
        progress.tracking_run_id = state.get("tracking_run_id")
        ckpt.set_rng_state(state["rng"])
        log.info("resumed from %s at step %d", saved["path"], progress.step)

    def maybe_save(self, progress: Progress) -> None:
        """Every `checkpoint.every` steps; the last step's is the final save, after the loop."""
        if progress.due(self.cfg.checkpoint.every) and not progress.done:
            self.save(progress)

    def save(self, progress: Progress, wait: bool = False) -> Path:
        """Checkpoint this step; `wait` returns only once it is on disk."""
        state = {
            "cursor": list(progress.cursor),
            "compatibility": self.compatibility(),
            "total_steps": progress.total_steps,
            "data_rows": self.parts.dataset.stats.to_dict(),
            "tracking_run_id": progress.tracking_run_id,
        }
        self.writer.wait()  # one snapshot in memory at a time
        p = self.parts
        snap = ckpt.snapshot(p.drafter, p.optimizer, p.scheduler, state, extra_files={
            "config.yaml": dump_config(self.cfg), "manifest.json": json.dumps(self.manifest, indent=2)})
        step = progress.step
        self.writer.submit(lambda: self._write(step, snap))
        if wait or not self.cfg.checkpoint.background:
            self.writer.wait()
        return ckpt.checkpoint_path(self.run_dir, step)

    def _write(self, step: int, snap: dict) -> None:
        path = ckpt.write_checkpoint(self.run_dir, step, snap)
        if self.uploader is not None:
            self.uploader.enqueue(path)
        safe = self.uploader.is_safe_to_delete if self.uploader is not None else (lambda _: True)
        prune_local(ckpt.checkpoints_dir(self.run_dir), self.cfg.checkpoint.keep_last, safe)

    def close(self, timeout: float | None = None) -> None:
        """Waits for the uploads, an hour or `timeout` s (local copies are kept where they did not finish)."""
        if self.uploader is None:
            return
        if not self.uploader.wait(timeout=3600 if timeout is None else timeout):
            log.warning("checkpoint uploads did not finish; local copies are kept")
        self.uploader.close()
