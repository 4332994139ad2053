"""The figure recipes are tuned for: held-out acceptance against the device time it cost.

Every `eval.heldout_every` steps (and at the end) the drafter is scored on held-out answers of the
target (`eval.heldout_files`, e.g. its regenerated answers to held-out prompts): loss, per-slot
accuracy, tau_hat and tau_accept over random anchors, and tau_decode, greedy speculative decoding
replayed over the answers (real tau when they are the target's greedy ones), all teacher-forced,
no update. Each record carries `device_seconds`: the run's
wall-clock since `fit` started times the devices it holds, less the probe's own time (the
measurement is not part of the recipe). Two recipes are compared at equal device-seconds, never at
equal steps. Records go to <run_dir>/heldout.jsonl and the tracker under `heldout/`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tqdm import tqdm

from dflash_train.config import RunConfig
from dflash_train.data.batching import make_batches
from dflash_train.data.dataset import TokenizedDataset, tokenize_files
from dflash_train.draft.acceptance import LossTally, acceptance_metrics
from dflash_train.draft.objective import make_task
from dflash_train.eval.replay import replayed_rounds
from dflash_train.train.accumulate import MicroBatch, accumulate
from dflash_train.train.batches import HELDOUT_SALT, anchor_seed, collate_as_trained
from dflash_train.train.build import RunParts
from dflash_train.train.progress import Progress
from dflash_train.train.tracking import Tracker


@torch.enable_grad()
def score_heldout(parts: RunParts, cfg: RunConfig, dataset: TokenizedDataset) -> dict:
    """Held-out loss, per-slot accuracy and tau_hat of the run's current drafter, teacher-forced
    (no update): fixed batches and anchors, so two calls on the same weights agree.

    The compiled layers and loss must see what training shows them, or they recompile after warm-up
    (5 times at the first probe of the SmolLM2 recipe): the batches take training's bucket shapes,
    and grad mode stays on, which torch.compile guards on. Each micro-batch's graph is dropped
    unused before the next forward (`accumulate`); `LossTally` keeps only detached sums."""
    device, dc = parts.device, cfg.data
    batches = make_batches(dataset.lengths, dc.token_budget, dc.max_batch_size, 0, 0, dc.buckets)
    weight_sum = torch.zeros((), device=device)

    def micro_batches():
        nonlocal weight_sum
        for index, indices in enumerate(batches):  # one batch on the device at a time
            batch = collate_as_trained(dataset, indices, device, dc)
            task = make_task(batch["input_ids"], batch["loss_mask"], cfg.objective,
                             anchor_seed(cfg.seed, HELDOUT_SALT, index))
            weight_sum = weight_sum + task.weights.sum()
            yield MicroBatch(task, lambda b=batch: parts.target.features(b["input_ids"], parts.stream_layers),
                             batch["num_tokens"])

    tally = accumulate(parts.forward, micro_batches(), LossTally(parts.drafter.config.block_size, device))
    loss = float(tally.loss_sum / weight_sum.clamp(min=1e-12))
    return {"loss": loss, **acceptance_metrics(tally.correct, tally.counted, tally.accepted)}


@torch.no_grad()
def replay_heldout(parts: RunParts, dataset: TokenizedDataset, new_tokens: int) -> dict:
    """Real greedy tau over the held-out answers' first `new_tokens` tokens, replayed teacher-forced
    (eval/replay.py): what `dflash-train eval` would measure on these prompts if the answers are the
    target's greedy decodes. Eager: the compiled draft layers must not recompile for these shapes."""
    lengths = []
    with torch.compiler.set_stance("force_eager"):
        for ids, mask in zip(dataset.input_ids, dataset.loss_mask):
            lengths += replayed_rounds(parts.target, parts.drafter, torch.as_tensor(ids, device=parts.device).long(),
                                       torch.as_tensor(mask, device=parts.device), new_tokens)
    return {"tau_decode": sum(lengths) / max(len(lengths), 1), "decode_rounds": len(lengths)}


class HeldoutProbe:
    def __init__(self, cfg: RunConfig, parts: RunParts, dataset: TokenizedDataset, tracker: Tracker, devices: int):
        self.cfg, self.parts, self.dataset, self.tracker = cfg, parts, dataset, tracker
        self.every, self.devices = cfg.eval.heldout_every, max(devices, 1)
        self.decode_tokens = cfg.eval.heldout_decode_tokens
        self.path = Path(cfg.run_dir) / "heldout.jsonl"
        self.start = time.perf_counter()
        self.own_seconds = 0.0
        self.offset = 0.0  # device-seconds of earlier runs of this job (resume)

    @classmethod
    def for_run(cls, cfg: RunConfig, parts: RunParts, tracker: Tracker, devices: int = 1) -> HeldoutProbe | None:
        ec, dc = cfg.eval, cfg.data
        if not ec.heldout_files:
            return None
        dataset = tokenize_files(ec.heldout_files, parts.target.tokenizer, dc.max_length, skip_invalid=True,
                                 template_kwargs=dc.chat_template_kwargs)
        if not len(dataset):
            raise ValueError(f"eval.heldout_files {ec.heldout_files}: no usable rows ({dataset.stats.to_dict()})")
        return cls(cfg, parts, dataset, tracker, devices)

    def restart(self, step: int) -> None:
        """Called when training starts at `step`: the clock starts, and a resumed run continues its
        device-seconds."""
        self.start, self.own_seconds = time.perf_counter(), 0.0
        if self.path.is_file():
            records = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            earlier = [r for r in records if r["step"] <= step]
            self.offset = earlier[-1]["device_seconds"] if earlier else 0.0

    def due(self, step: int, last: bool) -> bool:
        return last or (self.every > 0 and step % self.every == 0)

    def maybe_run(self, progress: Progress) -> None:
        """Every `eval.heldout_every` steps, and after the last."""
        if not self.due(progress.step, progress.done):
            return
        heldout = self.run(progress.step)
        decode = f"tau_decode {heldout['tau_decode']:.3f}, " if "tau_decode" in heldout else ""
        tqdm.write(f"held-out at step {progress.step} ({heldout['device_seconds']:.0f} device-s): {decode}"
                   f"tau_hat {heldout['tau_hat']:.3f}, tau_accept {heldout['tau_accept']:.3f}, "
                   f"loss {heldout['loss']:.3f}")

    def run(self, step: int) -> dict:
        t0 = time.perf_counter()
        device_seconds = self.offset + (t0 - self.start - self.own_seconds) * self.devices
        with self.parts.forward.evaluating():
            metrics = score_heldout(self.parts, self.cfg, self.dataset)
            if self.decode_tokens:
                metrics.update(replay_heldout(self.parts, self.dataset, self.decode_tokens))
        record = {"step": step, "device_seconds": round(device_seconds, 2), **metrics,
                  "rows": len(self.dataset)}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.tracker.log({f"heldout/{k}": v for k, v in record.items() if k not in ("step", "acc")}, step)
        self.own_seconds += time.perf_counter() - t0
        return record
