"""`eval.every`: real speculative decoding of held-out prompts every N steps during training
(the evaluator: eval/report.py periodic_evaluator), recorded in eval.jsonl and the tracker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from dflash_train.config import RunConfig
from dflash_train.draft.model import DFlashDraftModel
from dflash_train.targets.model import Target
from dflash_train.train.build import RunParts
from dflash_train.train.progress import Progress
from dflash_train.train.tracking import Tracker

Evaluator = Callable[[Target, DFlashDraftModel], dict]
"""The current drafter's figures on the target: tau, num_rounds, ..."""


class PeriodicEval:
    def __init__(self, evaluate: Evaluator, cfg: RunConfig, parts: RunParts, tracker: Tracker):
        self.evaluate, self.every, self.parts, self.tracker = evaluate, cfg.eval.every, parts, tracker
        self.path = Path(cfg.run_dir) / "eval.jsonl"

    def maybe_run(self, progress: Progress) -> None:
        """Every `eval.every` steps (0: never)."""
        if not progress.due(self.every):
            return
        with self.parts.forward.evaluating(), self.parts.target.eager():
            record = {"step": progress.step, **self.evaluate(self.parts.target, self.parts.drafter)}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.tracker.log({f"eval/{k}": v for k, v in record.items() if k != "step"}, progress.step)
        tqdm.write(f"eval at step {progress.step}: tau {record['tau']:.3f} ({record['num_rounds']} rounds)")
