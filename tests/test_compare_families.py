"""examples/compare_families.sh, DFlash against DFlash2 and DSpark at equal minutes, keeps working: the same
script on CPU with a dozen prompts, two training steps an arm, and one prompt per eval set."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from example_runs import TINY_ARM, example_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow(seconds=200)
@pytest.mark.timeout(1200)
def test_the_family_comparison_runs_every_arm_on_cpu(tmp_path):
    root = tmp_path / "families"
    env = example_env(ROOT=str(root), MULTI_PROMPTS="0", ARMS="dflash-decay dflash2 warm-join dspark",
                      COMMON_ARGS=f"{TINY_ARM} data.length_bucket=0 data.max_length=256 data.token_budget=256")
    done = subprocess.run(["bash", str(ROOT / "examples" / "compare_families.sh"), "all"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for arm, family in (("dflash-decay", "DFlashDraftModel"), ("dflash2", "DFlash2DraftModel"), ("warm-join", "DFlash2DraftModel"),
                         ("dspark", "DSparkDraftModel")):
        assert json.loads((root / arm / "summary.json").read_text())["steps"] == 2
        assert json.loads((root / arm / "export" / "config.json").read_text())["architectures"] == [family]
        for name in ("sharegpt", "humaneval", "mt-bench"):
            report = json.loads((root / arm / "eval" / name / "eval.json").read_text())
            assert report["lossless"]["matches"] == report["lossless"]["total"] > 0, (arm, name)
    assert "init_from: " in (root / "warm-join" / "config.yaml").read_text()
    assert "selector_outside_top_k: join" in (root / "warm-join" / "config.yaml").read_text()
    assert "selector_outside_top_k: join" not in (root / "warm-dflash-join" / "config.yaml").read_text()  # DFlash half
    assert "slot_weights: decay" in (root / "dflash-decay" / "config.yaml").read_text()  # the -decay variant
    assert "slot_weights: dpace" in (root / "dflash2" / "config.yaml").read_text()  # the default
    assert "slot_weights: decay" in (root / "dspark" / "config.yaml").read_text()  # its logit bias takes no D-PACE
    table = done.stdout.splitlines()
    assert [line.split()[0] for line in table if line.split() and line.split()[0] in ("dflash-decay", "dflash2", "warm-join", "dspark")] \
        == ["dflash-decay", "dflash2", "warm-join", "dspark"]
