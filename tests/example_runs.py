"""What the CPU runs of examples/*.sh share: this venv's python3 first on PATH, and the SmolLM2 chain
shrunk to a dozen prompts, a few answer tokens and one prompt per eval set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

TINY_ARM = ("target.dtype=auto train.time_budget_minutes=null train.max_steps=2 objective.num_anchors=4 "
            "train.compile=false train.compile_loss=false draft.num_layers=1 draft.num_target_features=2 "
            "draft.dflash2.conv_group_size=64 checkpoint.every=100")
"""Overrides every arm of a comparison script takes on CPU: two steps of a one-layer drafter, nothing compiled."""


def example_env(**values: str) -> dict[str, str]:
    """The environment of an example script on CPU: the shrunk chain, then `values`."""
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3 = this venv's
        "DEVICE": "cpu", "NUM_PROMPTS": "6", "HELDOUT": "1", "ANSWER_TOKENS": "10", "BATCH": "8", "EVAL_BATCH": "2",
        "NEW_TOKENS": "6", "EVAL_PROMPTS": "1", "EVERY_PROMPTS": "8", "CODE_PROMPTS": "0", "MAX_CHARS": "200",
        "ENGINE": "static", **values,
    }
