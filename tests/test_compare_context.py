"""examples/compare_context.sh, a drafter trained on long rows against the recipe's length at equal minutes,
keeps working: the same script on CPU with a dozen prompts, two training steps an arm, one prompt per
short eval set and one two-turn conversation for the long set."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from example_runs import TINY_ARM, example_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow(seconds=150)
@pytest.mark.timeout(1200)
def test_the_context_comparison_trains_both_arms_and_reads_the_long_set_by_context(tmp_path):
    root = tmp_path / "context"
    long_file = tmp_path / "long.jsonl"
    long_file.write_text(json.dumps({"id": "long/0", "messages": [
        {"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "And three animals."}]}) + "\n")
    env = example_env(ROOT=str(root), MULTI_PROMPTS="2", MULTI_TURNS="3", LONG_FILE=str(long_file), LONG_PROMPTS="1",
                      LONG_BATCH="1", SHORT_LENGTH="256", LONG_LENGTH="512", LONG_BUCKETS="[128,256,512]",
                      COMMON_ARGS=f"{TINY_ARM} data.max_length=256 data.token_budget=512")
    done = subprocess.run(["bash", str(ROOT / "examples" / "compare_context.sh"), "all"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    prepared = json.loads((root / "long-data" / "prepared" / "dataset.json").read_text())
    assert prepared["max_length"] == 512  # the same answers, tokenised at the long arm's length
    for arm, length in (("short", 256), ("long", 512)):
        run = root / arm / "dflash2"
        assert json.loads((run / "summary.json").read_text())["steps"] == 2
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["data"]["max_length"] == length
        assert config["data"]["train_files"] == [str((root / ("data" if arm == "short" else "long-data") / "prepared"))]
        long_arm = arm == "long"
        assert config["data"]["length_buckets"] == ([128, 256, 512] if long_arm else [])
        assert config["objective"]["num_anchors_length"] == (256 if long_arm else None)
        for name in ("sharegpt", "humaneval", "mt-bench", "long"):
            report = json.loads((run / "eval" / name / "eval.json").read_text())
            assert report["lossless"]["matches"] == report["lossless"]["total"] > 0, (arm, name)
        assert json.loads((run / "eval" / "long" / "eval.json").read_text())["num_turns"] == 2  # turn after turn
    table = done.stdout.splitlines()
    assert [line.split()[0] for line in table if line.startswith(("short", "long "))] == ["short", "long"]
    assert sum("long set by context: 0-1K" in line for line in table) == 2
    env["ARMS"] = "long"  # one arm alone: its table row, the other arm's run untouched
    done = subprocess.run(["bash", str(ROOT / "examples" / "compare_context.sh"), "table"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split()[0] for line in done.stdout.splitlines() if line.startswith(("short", "long "))] == ["long"]
    env["ARMS"] = "short lng"
    done = subprocess.run(["bash", str(ROOT / "examples" / "compare_context.sh"), "table"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown arm 'lng' in ARMS (short, long)" in done.stderr
