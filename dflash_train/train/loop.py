"""The training loop: build -> (resume) -> steps -> checkpoints -> summary.

A run is its built parts (train/build.py), where it stands (`Progress`), and the components that
act on them: the step (train/step.py), the record (step_log.py), the checkpointer, the time limits
(budget.py), the held-out probe (heldout.py) and the periodic eval. Each periodic component decides
itself whether it is due, from the progress. `train` runs one process, `train_replica` one drafter
rank of distributed training (distributed/roles.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path


from dflash_train.checkpoint.storage import checkpoint_to_resume
from dflash_train.checks.profile import StepProfiler, extras_after
from dflash_train.config import RunConfig
from dflash_train.data.dataset import TokenizedDataset
from dflash_train.disk import writes_to
from dflash_train.run_lock import RunLock
from dflash_train.targets.model import Target
from dflash_train.train.accumulate import Replica
from dflash_train.train.budget import TimeLimits
from dflash_train.train.build import RunParts, build
from dflash_train.train.checkpointer import Checkpointer
from dflash_train.train.heldout import HeldoutProbe
from dflash_train.train.periodic_eval import Evaluator, PeriodicEval
from dflash_train.train.progress import Progress
from dflash_train.train.step import TrainStep
from dflash_train.train.step_log import StepLog
from dflash_train.train.stop_signals import EXIT_STATUS, StopSignals
from dflash_train.train.tracking import Tracker

log = logging.getLogger("dflash_train")


class Trainer:
    """One run's training. A distributed drafter rank is this class with a `Replica` (where its
    micro-batches come from, how its sums are combined), not a subclass."""

    def __init__(self, cfg: RunConfig, parts: RunParts | None = None, *, target: Target | None = None,
                 dataset: TokenizedDataset | None = None, periodic_eval: Evaluator | None = None,
                 replica: Replica | None = None):
        self.cfg = cfg
        self.parts = parts or build(cfg, target, dataset)  # data -> target -> drafter -> objective -> optimizer
        self.progress = Progress(total_steps=self.parts.total_steps)
        self.devices = replica.devices if replica else 1  # for device-seconds (distributed: the world size)
        self.tracker = Tracker(cfg.tracking)
        self.checkpointer = Checkpointer(cfg, self.parts)
        self.stepper = TrainStep(cfg, self.parts, replica)
        self.periodic_eval = periodic_eval and PeriodicEval(periodic_eval, cfg, self.parts, self.tracker)

    def train_step(self) -> dict:
        return self.stepper(self.progress)

    def resume(self, path: str | Path) -> None:
        self.checkpointer.resume(path, self.progress)

    def fit(self, progress: bool = True, signals: StopSignals | None = None) -> dict:
        """Steps to the run's end (or its deadline), each periodic part run where it is due, then the
        final checkpoint. Time between steps is logged apart from training time. With `signals`
        installed, SIGTERM or Ctrl-C ends the run after the step in flight, saved
        (train/stop_signals.py)."""
        cfg, run, parts = self.cfg, self.progress, self.parts
        manifest = self.checkpointer.start()
        run.tracking_run_id = self.tracker.start(Path(cfg.run_dir), cfg.model_dump(mode="json"), manifest,
                                                 run_id=run.tracking_run_id)
        step_log = StepLog(cfg, parts, run, manifest=manifest, tracker=self.tracker, show=progress)
        probe = HeldoutProbe.for_run(cfg, parts, self.tracker, self.devices)
        self.stepper.prepare()  # compiles and captures: before any clock starts
        if probe is not None:
            probe.restart(run.step)
        step_log.start()
        limits = TimeLimits(cfg.train, run, parts.scheduler)
        profiler = StepProfiler(cfg.train.profile_at_step, Path(cfg.run_dir), parts.device, extras_after(cfg))
        try:
            while not run.done:
                with profiler.step(run.step):
                    out = self.train_step()
                limits.maybe_stop(run, step_log.paused_total)
                self.maybe_stop_on_signal(signals)
                step_log.maybe_log(out, run)
                with step_log.pause():
                    profiler.flush()
                    if run.stopped not in EXIT_STATUS:  # evaluations would spend the grace period
                        if self.periodic_eval is not None:
                            self.periodic_eval.maybe_run(run)
                        if probe is not None:
                            probe.maybe_run(run)
                    self.checkpointer.maybe_save(run)
        except BaseException:
            profiler.abort()
            raise
        profiler.close(run.step)
        step_log.close()
        return self._finish(step_log.last, signals.remaining() if signals is not None else None)

    def maybe_stop_on_signal(self, signals: StopSignals | None) -> None:
        """After a step: stop when a signal came, to this process or (distributed) to any replica of
        its group, so that all of them stop after the same step."""
        if signals is None:
            return
        flags = self.stepper.reduction.any_of([signals.received == name for name in EXIT_STATUS], self.parts.device)
        if (name := next((n for n, f in zip(EXIT_STATUS, flags) if f), None)) is not None:
            self.progress.stopped = name
            log.info("%s: stopping at step %d of %d", name, self.progress.step, self.progress.total_steps)

    def _finish(self, last: dict, grace: float | None = None) -> dict:
        """The final checkpoint (waited for, uploads too: for `grace` seconds after a stop signal), the
        tracker closed, summary.json."""
        run, dataset = self.progress, self.parts.dataset
        final = self.checkpointer.save(run, wait=True)
        self.tracker.finish()
        self.checkpointer.close(timeout=grace)
        summary = {"steps": run.step, "total_steps": run.total_steps, "stopped": run.stopped or "end",
                   "checkpoint": str(final), "data_rows": dataset.stats.to_dict(),
                   "data_lengths": dataset.length_stats(), "last": last}
        (Path(self.cfg.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def train(cfg: RunConfig, resume: str | None = None, target: Target | None = None, progress: bool = True,
          periodic_eval: Evaluator | None = None, parts: RunParts | None = None) -> dict:
    """Trains `cfg`'s drafter in this process (`dflash-train train`); returns the summary. `parts`:
    the run built by the caller (`build(cfg)`), who may then use them before and after training."""
    with RunLock(cfg.run_dir, "train"):  # before anything loads: a second writer is refused at once
        path = None  # checked before the target loads: a corrupt checkpoint chosen by hand fails at once
        if resume:
            path = checkpoint_to_resume(resume, cfg.run_dir, endpoint_url=cfg.checkpoint.endpoint_url,
                                        region=cfg.checkpoint.region)
        trainer = Trainer(cfg, parts, target=target, periodic_eval=periodic_eval)
        if resume and path is None:
            log.info("--resume auto: no intact checkpoint in %s, starting fresh", cfg.run_dir)
        elif path is not None:
            trainer.resume(path)
        with writes_to(cfg.run_dir), StopSignals(cfg.checkpoint.grace_seconds) as signals:
            return trainer.fit(progress=progress, signals=signals)


def train_replica(cfg: RunConfig, parts: RunParts, replica: Replica, resume: str | Path | None = None,
                  periodic_eval: Evaluator | None = None) -> str | None:
    """One data-parallel replica of a drafter group: the leader runs the whole loop (evaluates, logs
    and saves); the others step in lockstep, waiting in the all-reduces. A stop signal to any of them
    stops all after the same step (the leader saves it); returns the signal's name, else None."""
    trainer = Trainer(cfg, parts, periodic_eval=periodic_eval, replica=replica)
    if resume:
        trainer.resume(resume)
    replica.start(trainer.progress)
    # A second SIGTERM is the launcher passing the scheduler's on: only SIGKILL (or the grace period) cuts the save.
    with StopSignals(cfg.checkpoint.grace_seconds, second_ends=False) as signals:
        if replica.leader:
            trainer.fit(progress=True, signals=signals)
        else:
            while not trainer.progress.done:
                trainer.train_step()
                trainer.maybe_stop_on_signal(signals)
    return trainer.progress.stopped if trainer.progress.stopped in EXIT_STATUS else None
