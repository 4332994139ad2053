"""The single-process training loop: build -> (resume) -> steps -> checkpoints -> summary.

One optimizer step = `grad_accum` micro-batches. Loss weights are known before the drafter runs,
so the step's GLOBAL weight sum is computed first and every micro-batch's weighted CE sum is divided
by it: the loss is exactly sum(w * CE) / sum(w) over the whole step, however it is split.
The hot path has no host sync; metrics are pulled to the host every `log_every` steps.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from dflash_train.train.capture import CapturedFeatures, fingerprint
from dflash_train.config import RunConfig, dump_config
from dflash_train.data.batching import bucket_shape
from dflash_train.data.dataset import TokenizedDataset
from dflash_train.draft.loss import LossTally, acceptance_metrics, loss_chunk_rows
from dflash_train.draft.objective import draft_loss, make_task
from dflash_train.checks import compile_cache
from dflash_train.checks.guard import ThroughputGuard
from dflash_train.checks.manifest import build_manifest, write_manifest
from dflash_train.checks.profile import StepProfiler, extras_after
from dflash_train.checks.recompiles import RecompileWatch
from dflash_train.targets.model import Target, synced_time
from dflash_train.checkpoint import local as ckpt
from dflash_train.train.batches import anchor_seed, collate_as_trained, take
from dflash_train.train.shapes import autocast_for, compile_layers
from dflash_train.train.accumulate import LocalSource, NoReduction, Reduction, Source, accumulate
from dflash_train.train.feature_cache import FeatureCache, from_capture, from_target, step_reserve
from dflash_train.train.step_graph import StepGraphs
from dflash_train.train.heldout import HeldoutProbe, score_heldout
from dflash_train.train.metrics import MetricsFile
from dflash_train.checkpoint.storage import checkpoint_to_resume, prune_local
from dflash_train.train.tracking import Tracker
from dflash_train.train.budget import Deadline, TimeBudget
from dflash_train.train.optim import refit_scheduler, retarget_scheduler
from dflash_train.train.build import build, check_write_locations
from dflash_train.disk import writes_to

log = logging.getLogger("dflash_train")


class Trainer:
    """The drafter's training: data, target and drafter, optimizer and schedule, the loop, its records
    and checkpoints. Where a step's micro-batches come from (`source`) and how its sums are combined
    across replicas (`reduction`) are parts: a distributed drafter rank is this class with other parts
    (distributed/roles.py), not a subclass."""

    def __init__(self, cfg: RunConfig, target: Target | None = None, dataset: TokenizedDataset | None = None,
                 periodic_eval: Callable[[Trainer], dict] | None = None, source: Source | None = None,
                 reduction: Reduction | None = None, devices_held: int = 1):
        self.cfg = cfg
        self.periodic_eval = periodic_eval  # real speculative decoding every eval.every steps (eval/)
        self.source = source or LocalSource()
        self.reduction = reduction or NoReduction()
        self.devices_held = devices_held  # for device-seconds (distributed ranks: the world size)
        self.run_dir = Path(cfg.run_dir)
        check_write_locations(cfg)
        parts = build(cfg, target, dataset)  # data -> target -> drafter -> objective -> plan -> optimizer
        self.device, self.target, self.dataset, self.drafter = parts.device, parts.target, parts.dataset, parts.drafter
        self.loss_mix, self.stream_layers, self.use_flex = parts.loss_mix, parts.stream_layers, parts.use_flex
        self.epoch_batches, self.total_steps = parts.epoch_batches, parts.total_steps
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.chunk_rows = loss_chunk_rows(cfg.objective.ce_chunk_size, self.target.vocab_size)
        self.captured = None  # data.captured_features: the target's features read from disk
        if cfg.data.captured_features:
            self.captured = CapturedFeatures(cfg.data.captured_features,
                                             fingerprint(self.target, self.stream_layers, self.dataset))
        self.step = 0
        self.manifest: dict | None = None  # written at the start of fit(); checkpoints carry it
        self.cursor = (0, 0)  # (epoch, batch index) of the next micro-batch
        self.feature_cache = None
        if cfg.data.cache_features:
            self.feature_cache = FeatureCache(self.dataset, self.device,
                                              step_reserve(self.chunk_rows, self.target.vocab_size))
        # where the cache's missing rows come from (the target is looked up per call: tests swap it)
        self.make_rows = (from_capture(self.captured, self.device) if self.captured is not None else
                          from_target(self.dataset, self.device, lambda ids: self.target.features(ids, self.stream_layers)))
        self.uploader = None  # background uploads to checkpoint.remote
        if cfg.checkpoint.remote:
            from dflash_train.checkpoint.uploader import remote_uploader  # boto3 only when asked for

            self.uploader = remote_uploader(cfg.checkpoint)
        self.checkpoint_writer = ckpt.CheckpointWriter()
        self.tracker = Tracker(cfg.tracking)
        self.tracking_run_id: str | None = None
        self.compile_key: str | None = None  # set when a compiled path uses the persistent cache
        self.compile_state = self._activate_compile_cache()
        self.recompiles = RecompileWatch()
        if cfg.train.compile:
            compile_layers(self.drafter, len(self.bucket_shapes()) if cfg.data.length_bucket else None)
        self.step_graphs = StepGraphs.for_trainer(self) if cfg.train.cuda_graphs else None

    def _activate_compile_cache(self) -> str | None:
        """Compiled paths (flex on GPU, train.compile) get the persistent keyed cache, never /tmp."""
        if not self.use_flex and not self.cfg.train.compile:  # flex is only ever chosen on CUDA
            return None
        key = compile_cache.cache_key()
        state = compile_cache.cache_state(key)
        compile_cache.activate(key)
        self.compile_key = key
        return state

    def autocast(self):
        """The run's autocast, a new context each time: run_eval's wraps draft_forward's, and one
        autocast object entered twice restores the wrong state on exit (left on after an eval)."""
        return autocast_for(self.device, self.target.embed_weight.dtype)

    def draft_forward(self, task, features):
        """The drafter's loss on one micro-batch, in the run's precision and attention path."""
        with self.autocast():
            return draft_loss(self.drafter, task, features, self.target.embed_weight, self.target.lm_head_weight,
                              self.use_flex, self.chunk_rows, self.loss_mix, self.target.logits,
                              compiled_loss=self.cfg.train.compile_loss, ce_kernel=self.cfg.train.ce_kernel,
                              even_chunks=bool(self.cfg.data.length_bucket))

    @property
    def attention_backend(self) -> str:
        return "flex" if self.use_flex else "sdpa"

    # ---- identity and resume -------------------------------------------------------------
    def compatibility(self) -> dict:
        d = self.drafter.config
        return {
            "block_size": d.block_size,
            "target_layer_ids": d.target_layer_ids,
            "num_draft_layers": d.num_hidden_layers,
            "mask_token_id": d.mask_token_id,
            "target": self.target.identity,
        }

    def resume(self, path: str | Path) -> None:
        saved = ckpt.load_checkpoint(path, map_location=self.device)
        state = saved["state"]
        ckpt.check_resume_compatible(state["compatibility"], self.compatibility())
        self.drafter.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optim"]["optimizer"])
        self.scheduler.load_state_dict(saved["optim"]["scheduler"])
        # The schedule follows THIS run's length (train.max_steps may have been raised to train on):
        # same config -> the same rates as saved; a longer run -> the longer cosine, no jump.
        if self.cfg.train.time_budget_minutes and state.get("total_steps"):
            # A budgeted run's saved length is its ceiling: refitting from the full plan would push the
            # rate back up at every resume; this call's budget can only shorten it further. Its saved
            # schedule (refitted as it went) continues from the saved step.
            self.total_steps = min(self.total_steps, state["total_steps"])
        if self.cfg.train.time_budget_minutes and saved["optim"]["scheduler"]["lr_lambdas"][0] is not None:
            saved_schedule, tc = self.scheduler.lr_lambdas[0], self.cfg.train
            changed = [k for k in ("warmup_ratio", "min_lr_ratio", "schedule", "decay_ratio")
                       if getattr(saved_schedule, k) != getattr(tc, k)]
            if changed:
                log.warning("resume: the budgeted run continues its saved schedule; train.%s changed in the "
                            "config apply to new runs only", ", train.".join(changed))
            refit_scheduler(self.scheduler, self.total_steps)
        else:  # a fixed-length run, or a checkpoint from before schedules were saved: the plain schedule
            retarget_scheduler(self.scheduler, self.cfg.train, self.total_steps)
        self.step = state["step"]
        self.cursor = tuple(state["cursor"])
        self.tracking_run_id = state.get("tracking_run_id")
        ckpt.set_rng_state(state["rng"])
        log.info("resumed from %s at step %d", saved["path"], self.step)

    def save(self, wait: bool = False) -> Path:
        """Checkpoint this step. With checkpoint.background the disk write (and the upload and pruning
        after it) runs while training goes on; `wait` returns only once it is on disk."""
        state = {
            "cursor": list(self.cursor),
            "compatibility": self.compatibility(),
            "total_steps": self.total_steps,
            "data_rows": self.dataset.stats.to_dict(),
            "tracking_run_id": self.tracking_run_id,
        }
        self.checkpoint_writer.wait()  # one snapshot in memory at a time
        snap = ckpt.snapshot(self.drafter, self.optimizer, self.scheduler, state, extra_files={
            "config.yaml": dump_config(self.cfg), "manifest.json": json.dumps(self.manifest, indent=2)})
        step = self.step
        self.checkpoint_writer.submit(lambda: self._write_checkpoint(step, snap))
        if wait or not self.cfg.checkpoint.background:
            self.checkpoint_writer.wait()
        return ckpt.checkpoint_path(self.run_dir, step)

    def _write_checkpoint(self, step: int, snap: dict) -> None:
        path = ckpt.write_checkpoint(self.run_dir, step, snap)
        if self.uploader is not None:
            self.uploader.enqueue(path)
        safe = self.uploader.is_safe_to_delete if self.uploader is not None else (lambda _: True)
        prune_local(ckpt.checkpoints_dir(self.run_dir), self.cfg.checkpoint.keep_last, safe)

    # ---- data -------------------------------------------------------------------------------
    def next_micro_batch(self) -> tuple[dict, int]:
        (epoch, index), indices, self.cursor = take(self.epoch_batches, self.cursor)
        return (collate_as_trained(self.dataset, indices, self.device, self.cfg.data),
                anchor_seed(self.cfg.seed, epoch, index))

    def bucket_shapes(self) -> list[tuple[int, int]]:
        dc = self.cfg.data
        return [bucket_shape(n, dc.length_bucket, dc.token_budget, dc.max_batch_size)
                for n in range(dc.length_bucket, dc.max_length + dc.length_bucket, dc.length_bucket)]

    def synthetic_batch(self, rows: int, length: int, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
        """Random tokens, a loss mask over the last 3/4 and random features of a bucket's shape: the
        compiled and captured graphs depend on shapes only, and drafter-only ranks of distributed
        training hold no target layers to make real features with."""
        ids = torch.randint(0, self.target.vocab_size, (rows, length), generator=gen).to(self.device)
        loss_mask = torch.zeros_like(ids)
        loss_mask[:, length // 4 :] = 1
        feats = torch.randn(rows, length, len(self.stream_layers) * self.target.hidden_size,
                            generator=gen).to(self.device, self.target.embed_weight.dtype)
        return {"input_ids": ids, "loss_mask": loss_mask}, feats

    def compile_buckets(self) -> int:
        """One forward+backward per bucket shape (synthetic tokens, no update): compiles every graph
        the run will need, so training itself never recompiles. Returns the shapes compiled."""
        gen = torch.Generator().manual_seed(0)
        shapes = self.bucket_shapes()
        for rows, length in shapes:
            batch, feats = self.synthetic_batch(rows, length, gen)
            task = make_task(batch["input_ids"], batch["loss_mask"], self.cfg.objective, 0)
            self.draft_forward(task, feats).weighted_ce_sum.backward()
            self.drafter.zero_grad(set_to_none=self.step_graphs is None)
        self.recompiles.mark_warm()
        return len(shapes)

    def features(self, batch: dict) -> torch.Tensor:
        if self.feature_cache is not None:
            return self.feature_cache.features(batch, self.make_rows)
        if self.captured is not None:
            return self.captured.batch(batch, self.device)
        return self.target.features(batch["input_ids"], self.stream_layers)

    # ---- one optimizer step ----------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step over grad_accum micro-batches: the loss normalised by the step's global
        weight sum, gradients and statistics summed over the replicas (a plain sum, not DDP's mean:
        replicas may hold different numbers of micro-batches)."""
        if self.step_graphs is not None:
            return self._graphed_train_step()
        micro = self.source.micro_batches(self)
        weights = sum((mb.task.weights.sum() for mb in micro), torch.zeros((), device=self.device))
        denominator = self.reduction.sum(weights).clamp(min=1e-12)
        tally = accumulate(self.draft_forward, micro, LossTally(self.drafter.config.block_size, self.device),
                           denominator)
        stats = torch.cat([tally.loss_sum.view(1), tally.correct, tally.counted, tally.accepted])
        stats, tokens = self.reduction.finish(self.drafter.parameters(), stats, sum(mb.tokens for mb in micro))
        correct, counted, accepted = stats[1:].view(3, -1)
        return {"loss": stats[0] / denominator, "correct": correct, "counted": counted, "accepted": accepted,
                **self.optimizer_step(), "tokens": tokens}

    def _graphed_train_step(self) -> dict:
        """`train_step` through the step's CUDA graph (train.cuda_graphs: one micro-batch, one process)."""
        batch, seed = self.next_micro_batch()
        out = self.step_graphs.run(batch, self.features(batch), seed)
        return {"loss": out["loss_sum"] / out["weight_sum"], "correct": out["correct"], "counted": out["counted"],
                "accepted": out["accepted"], **self.optimizer_step(), "tokens": batch["num_tokens"]}

    def optimizer_step(self) -> dict:
        """Clip, update, advance the schedule; the gradients must already be summed and normalised."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.train.grad_clip)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step uses (the scheduler then moves on)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=self.step_graphs is None)  # the graphs write to fixed .grad
        self.step += 1
        if self.step == self.cfg.train.compile_warmup_steps and not self.cfg.data.length_bucket:
            self.recompiles.mark_warm()
        return {"grad_norm": grad_norm, "lr": lr}

    def evaluate(self, dataset: TokenizedDataset) -> dict:
        """Held-out loss, per-slot accuracy and tau_hat of the current drafter (no update)."""
        return score_heldout(self, dataset)

    # ---- the loop ---------------------------------------------------------------------------
    def fit(self, progress: bool = True) -> dict:
        tc = self.cfg.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
        self.manifest = manifest = build_manifest(self.cfg.model_dump(mode="json"), sys.argv, self.run_dir,
                                                  target=self.target.description)
        write_manifest(self.run_dir, manifest)
        self.guard = ThroughputGuard(self.run_dir.parent, manifest, warmup_steps=self.step + 2 * tc.log_every)
        self.tracking_run_id = self.tracker.start(
            self.run_dir, self.cfg.model_dump(mode="json"), manifest, run_id=self.tracking_run_id
        )
        metrics = MetricsFile(self.run_dir, resume_step=self.step)
        probe = HeldoutProbe.for_trainer(self, self.devices_held)
        if self.cfg.train.compile and self.cfg.data.length_bucket:
            t = time.perf_counter()
            n = self.compile_buckets()
            log.info("compiled %d bucket shapes in %.1f s (cache was %s)", n, time.perf_counter() - t,
                     self.compile_state)
        if self.step_graphs is not None:
            self.step_graphs.prepare(self.bucket_shapes())
        window: list[dict] = []
        last_record: dict = {}
        if probe is not None:
            probe.restart()
        t0 = synced_time(self.device)
        paused = paused_so_far = 0.0  # saves, evals, probes: logged apart, not counted as training time
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not progress, desc="train", dynamic_ncols=True)
        planned = self.total_steps
        budget = tc.time_budget_minutes and TimeBudget(tc.time_budget_minutes, self.step, tc.compile_warmup_steps,
                                                       tc.log_every)
        deadline = tc.deadline_minutes and Deadline(tc.deadline_minutes)
        stopped = "end"
        profiler = StepProfiler(tc.profile_at_step, self.run_dir, self.device, extras_after(self.cfg))
        try:
            while self.step < self.total_steps:
                with profiler.step(self.step):
                    window.append(self.train_step())
                bar.update(1)
                fitted = budget and budget.steps_that_fit(self.step, planned, paused_so_far)
                if fitted and fitted != self.total_steps:
                    log.log(logging.INFO if budget.worth_reporting(fitted) else logging.DEBUG,
                            "time budget: %d of %d planned steps fit; the schedule now ends there", fitted, planned)
                    self.total_steps = bar.total = fitted
                    refit_scheduler(self.scheduler, fitted)
                at_deadline = bool(deadline) and self.step < self.total_steps and deadline.reached()
                if self.step % tc.log_every == 0 or self.step == self.total_steps or at_deadline:
                    # The window ends once the device has run its steps: a host that runs ahead of the
                    # device (CUDA graph replays) would otherwise time its launches, and the windows
                    # tile the run's wall time (logging's own time falls into the next one).
                    now = synced_time(self.device)
                    last_record = self._log(window, now - t0, paused, metrics)
                    bar.set_postfix(loss=f"{last_record['loss']:.3f}", tau_hat=f"{last_record['tau_hat']:.2f}",
                                    tok_s=f"{last_record['tokens_per_s']:.0f}")
                    window, t0, paused = [], now, 0.0
                t_pause = time.perf_counter()
                profiler.flush()
                if self.periodic_eval is not None and self.cfg.eval.every and self.step % self.cfg.eval.every == 0:
                    self._run_periodic_eval()
                if probe is not None and probe.due(self.step, self.step == self.total_steps or at_deadline):
                    heldout = probe.run(self.step)
                    decode = f"tau_decode {heldout['tau_decode']:.3f}, " if "tau_decode" in heldout else ""
                    tqdm.write(f"held-out at step {self.step} ({heldout['device_seconds']:.0f} device-s): {decode}"
                               f"tau_hat {heldout['tau_hat']:.3f}, tau_accept {heldout['tau_accept']:.3f}, "
                               f"loss {heldout['loss']:.3f}")
                if at_deadline:  # the final save below holds this step; the schedule is left as it is
                    stopped = "deadline"
                    log.info("deadline: stopping at step %d of %d; --resume auto continues the same schedule",
                             self.step, self.total_steps)
                    break
                if self.step % self.cfg.checkpoint.every == 0 and self.step < self.total_steps:
                    self.save()
                pause = time.perf_counter() - t_pause
                paused, paused_so_far = paused + pause, paused_so_far + pause
        except BaseException:
            profiler.abort()
            raise
        profiler.close(self.step)
        bar.close()
        final = self.save(wait=True)
        metrics.close()
        self.tracker.finish()
        if self.uploader is not None:
            if not self.uploader.wait(timeout=3600):
                log.warning("checkpoint uploads did not finish; local copies are kept")
            self.uploader.close()
        summary = {"steps": self.step, "total_steps": self.total_steps, "stopped": stopped, "checkpoint": str(final),
                   "data_rows": self.dataset.stats.to_dict(), "data_lengths": self.dataset.length_stats(),
                   "last": last_record}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def run_eval(self, evaluator: Callable[[Trainer], dict]) -> dict:
        """`evaluator(self)` with the drafter in eval mode and the run's autocast (fp32 weights,
        bf16 target features on GPU), then back to training."""
        self.drafter.eval()
        try:
            with self.autocast():
                return evaluator(self)
        finally:
            self.drafter.train()

    def _run_periodic_eval(self) -> None:
        record = {"step": self.step, **self.run_eval(self.periodic_eval)}
        with open(self.run_dir / "eval.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        self.tracker.log({f"eval/{k}": v for k, v in record.items() if k != "step"}, self.step)
        tqdm.write(f"eval at step {self.step}: tau {record['tau']:.3f} ({record['num_rounds']} rounds)")

    def _log(self, window: list[dict], seconds: float, paused: float, metrics: MetricsFile) -> dict:
        """tokens_per_s counts training time only: a window that held a checkpoint save (seconds for a
        large drafter's optimizer state) or an eval would otherwise read as a throughput drop."""
        correct = sum(w["correct"] for w in window)
        counted = sum(w["counted"] for w in window)
        accepted = sum(w["accepted"] for w in window)
        tokens = sum(w["tokens"] for w in window)
        record = {
            "step": self.step,
            "epoch": self.cursor[0],
            "loss": float(torch.stack([w["loss"] for w in window]).mean()),
            "lr": window[-1]["lr"],
            "grad_norm": float(torch.stack([torch.as_tensor(w["grad_norm"]) for w in window]).mean()),
            "tokens": tokens,
            "tokens_per_s": tokens / max(seconds - paused, 1e-9),
            "paused_s": round(paused, 3),
            "attention_backend": self.attention_backend,
            "compiled_graphs": self.recompiles.graphs,
            "recompiles_since_warmup": self.recompiles.since_warm,
            **acceptance_metrics(correct, counted, accepted),
        }
        if self.device.type == "cuda":  # the run's peak so far: what a larger vocabulary or batch costs
            record["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
        for reason in self.recompiles.new_reasons():
            tqdm.write(f"WARNING: recompiled after warm-up (step {self.step}): {reason}")
        metrics.write(record)
        self.tracker.log(record, self.step)
        warning = self.guard.check(
            self.step, record["tokens_per_s"],
            {"compile_cache_state": self.compile_state, "attention_backend": self.attention_backend,
             "recompiles_since_warmup": self.recompiles.since_warm},
        )
        if warning:
            tqdm.write(warning)
        return record


def train(cfg: RunConfig, resume: str | None = None, target: Target | None = None, progress: bool = True,
          periodic_eval: Callable[[Trainer], dict] | None = None) -> dict:
    path = None  # checked before the target loads: a corrupt checkpoint chosen by hand fails at once
    if resume:
        path = checkpoint_to_resume(resume, cfg.run_dir, endpoint_url=cfg.checkpoint.endpoint_url,
                                    region=cfg.checkpoint.region)
    trainer = Trainer(cfg, target=target, periodic_eval=periodic_eval)
    if resume and path is None:
        log.info("--resume auto: no intact checkpoint in %s, starting fresh", cfg.run_dir)
    elif path is not None:
        trainer.resume(path)
    with writes_to(cfg.run_dir):  # a write that fails for want of space names at least the run
        return trainer.fit(progress=progress)
