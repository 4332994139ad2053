"""The training record: every `train.log_every` steps (and after the last) one line of the window's
loss, rates and acceptance to metrics.jsonl, the tracker and the progress bar, checked by the
throughput guard.

Metrics are pulled to the host only here. tokens_per_s counts training time only: the pauses
between steps (saves, evals, probes: seconds for a large drafter's optimizer state) are timed apart
and logged as paused_s, or a window that held one would read as a throughput drop.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from dflash_train.checks.guard import ThroughputGuard
from dflash_train.config import RunConfig
from dflash_train.draft.acceptance import acceptance_metrics
from dflash_train.targets.model import synced_time
from dflash_train.train.build import RunParts
from dflash_train.train.metrics import MetricsFile
from dflash_train.train.progress import Progress
from dflash_train.train.tracking import Tracker


class StepLog:
    def __init__(self, cfg: RunConfig, parts: RunParts, progress: Progress, *, manifest: dict, tracker: Tracker,
                 show: bool):
        run_dir = Path(cfg.run_dir)
        self.every, self.parts, self.tracker = cfg.train.log_every, parts, tracker
        self.recompiles = parts.compilation.recompiles
        self.guard = ThroughputGuard(run_dir.parent, manifest, warmup_steps=progress.step + 2 * self.every)
        self.metrics = MetricsFile(run_dir, resume_step=progress.step)
        self.window: list[dict] = []
        self.last: dict = {}
        self.paused = self.paused_total = 0.0  # in this window, and since training started
        self.bar = tqdm(total=progress.total_steps, initial=progress.step, disable=not show, desc="train",
                        dynamic_ncols=True)
        self.t0 = 0.0

    def start(self) -> None:
        """The first window starts now (after the warm-ups)."""
        self.t0 = synced_time(self.parts.device)

    def maybe_log(self, out: dict, progress: Progress) -> None:
        """Adds the step's outputs to the window, and records the window when it is due."""
        self.window.append(out)
        self.bar.total = progress.total_steps  # a time budget may have shortened the run
        self.bar.update(1)
        if progress.due(self.every) or progress.done:
            # The window ends once the device has run its steps: a host that runs ahead of the
            # device (CUDA graph replays) would otherwise time its launches, and the windows
            # tile the run's wall time (logging's own time falls into the next one).
            now = synced_time(self.parts.device)
            self.last = self._record(progress, now - self.t0)
            self.bar.set_postfix(loss=f"{self.last['loss']:.3f}", tau_hat=f"{self.last['tau_hat']:.2f}",
                                 tok_s=f"{self.last['tokens_per_s']:.0f}")
            self.window, self.t0, self.paused = [], now, 0.0

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Time spent inside is not training time (it counts against a time budget apart)."""
        t = time.perf_counter()
        yield
        pause = time.perf_counter() - t
        self.paused, self.paused_total = self.paused + pause, self.paused_total + pause

    def _record(self, progress: Progress, seconds: float) -> dict:
        window = self.window
        tokens = sum(w["tokens"] for w in window)
        backend = self.parts.forward.attention_backend
        record = {
            "step": progress.step,
            "epoch": progress.cursor[0],
            "loss": float(torch.stack([w["loss"] for w in window]).mean()),
            "lr": window[-1]["lr"],
            "grad_norm": float(torch.stack([torch.as_tensor(w["grad_norm"]) for w in window]).mean()),
            "tokens": tokens,
            "tokens_per_s": tokens / max(seconds - self.paused, 1e-9),
            "paused_s": round(self.paused, 3),
            "attention_backend": backend,
            "compiled_graphs": self.recompiles.graphs,
            "recompiles_since_warmup": self.recompiles.since_warm,
            **acceptance_metrics(*(sum(w[k] for w in window) for k in ("correct", "counted", "accepted"))),
        }
        device = self.parts.device
        if device.type == "cuda":  # the run's peak so far: what a larger vocabulary or batch costs
            record["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        for reason in self.recompiles.new_reasons():
            tqdm.write(f"WARNING: recompiled after warm-up (step {progress.step}): {reason}")
        self.metrics.write(record)
        self.tracker.log(record, progress.step)
        warning = self.guard.check(progress.step, record["tokens_per_s"],
                                   {"compile_cache_state": self.parts.compilation.cache_state, "attention_backend": backend,
                                    "recompiles_since_warmup": self.recompiles.since_warm})
        if warning:
            tqdm.write(warning)
        return record

    def close(self) -> None:
        self.bar.close()
        self.metrics.close()
