"""README's "Train your own drafter" block runs as written: each command in a shell, from prompts to
the export, with a tiny target and recipe in its variables. (Its last command, serve-check, needs a
target llama.cpp converts and serves: scripts/serve_gate.sh runs it on SmolLM2's drafter.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.generate.conftest import build_tiny_target

REPO = Path(__file__).resolve().parents[1]


def train_your_own_block() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Train your own drafter"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return block.strip().splitlines()


def test_the_block_is_at_most_eight_commands_and_sets_its_variables_first():
    lines = train_your_own_block()
    assert len(lines) <= 8 and re.fullmatch(r"TARGET=\S+ CONFIG=\S+ PROMPTS=\d+ HELDOUT=\d+", lines[0])
    assert all(line.startswith("dflash-train ") for line in lines[1:])


@pytest.mark.slow(seconds=90)
def test_train_your_own_runs_as_written_at_tiny_size(tmp_path):
    target = build_tiny_target(tmp_path / "target")
    recipe = {
        "run_dir": "runs/recipe", "seed": 0, "device": "cpu", "target": {"path": "unused", "dtype": "float32"},
        "draft": {"num_layers": 1, "target_layer_ids": [0, 1], "attention": "sdpa"},
        "objective": {"block_size": 4, "num_anchors": 8, "gamma": 4.0, "mask_token_id": 0},
        "data": {"train_files": ["unused"], "max_length": 4096, "token_budget": 8192, "max_batch_size": 4},
        "train": {"lr": 1e-3, "warmup_ratio": 0.0, "max_steps": 4, "log_every": 1},
        "checkpoint": {"every": 4, "keep_last": 1}, "eval": {"max_new_tokens": 8},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    lines = train_your_own_block()
    tiny = f"TARGET={target} CONFIG={tmp_path / 'recipe.yaml'} PROMPTS=6 HELDOUT=2"
    script = "\n".join(["set -e", tiny, *[line for line in lines[1:] if not line.startswith("dflash-train serve-check")]])
    bin_dir = str(Path(sys.executable).parent)  # the environment's `dflash-train`
    env = os.environ | {"PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len((tmp_path / "data" / "heldout_prompts.jsonl").read_text().splitlines()) == 2
    assert json.loads((tmp_path / "data" / "answers" / "summary.json").read_text())["ok"] == 4
    assert [json.loads(line)["step"] for line in (tmp_path / "runs" / "mine" / "metrics.jsonl").read_text().splitlines()
            if "loss" in line] == [1, 2, 3, 4]
    config = json.loads((tmp_path / "out" / "mine" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and (tmp_path / "out" / "mine" / "model.safetensors").is_file()
    assert "lossless" in done.stdout and "tau" in done.stdout
