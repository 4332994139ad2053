"""examples/smollm2_h200.sh, the real-data chain of the SmolLM2 benchmark, keeps working: the same
script on CPU with a dozen prompts, a few answer tokens and two training steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the whole chain, three eval sets included: minutes on 2 loaded cores
def test_smollm2_example_runs_end_to_end_on_cpu(tmp_path):
    run = tmp_path / "run"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3 = this venv's
        "RUN": str(run), "DEVICE": "cpu", "NUM_PROMPTS": "10", "HELDOUT": "2", "ANSWER_TOKENS": "12", "BATCH": "8",
        "EVAL_BATCH": "2", "NEW_TOKENS": "6", "EVAL_PROMPTS": "3", "CURVE_PROMPTS": "2", "SPEEDUP_PROMPTS": "1",
        "ENGINE": "continuous",
        "TRAIN_ARGS": "target.dtype=auto train.time_budget_minutes=null train.max_steps=3 objective.num_anchors=4 data.length_bucket=0 "
                      "data.max_length=256 data.token_budget=512 checkpoint.every=1 train.compile=false train.compile_loss=false",
    }
    done = subprocess.run(["bash", str(ROOT / "examples" / "smollm2_h200.sh"), "all"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len((run / "data" / "heldout_prompts.jsonl").read_text().splitlines()) == 2
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert (run / "export" / "config.json").is_file()
    probe = [json.loads(line) for line in (run / "heldout.jsonl").read_text().splitlines()]
    assert [r["step"] for r in probe] == [3] and probe[0]["rows"] == 2  # the held-out answers, scored at the end
    expected = {"humaneval": 3, "sharegpt": 2, "mt-bench": 6, "humaneval_step_00000001": 2,
                "humaneval_step_00000002": 2, "humaneval_speedup": 1}
    for name, turns in expected.items():
        report = json.loads((run / "eval" / name / "eval.json").read_text())
        assert report["num_turns"] == turns and report["lossless"] == {"matches": turns, "total": turns}, name
        assert (report["speedup"] is not None) == (name == "humaneval_speedup"), name

    # A second, sampled answer per prompt and answers to two code requests beside the greedy ones,
    # and a run that trains on all three.
    env.update(RUN=str(tmp_path / "mix"), DATA=str(run / "data"), TEMPERATURE="1.0", CODE_PROMPTS="2",
               TRAIN_FILES=f"{run / 'data' / 'train'},{run / 'data' / 'train_sampled'},{run / 'data' / 'code'}")
    for stage in ("generate-sampled", "generate-code", "train"):
        # transformers' continuous engine sizes its CPU cache from free memory (14 GB RSS for two
        # prompts of ~300 tokens): the code stage runs the static engine
        stage_env = {**env, "ENGINE": "static"} if stage == "generate-code" else env
        done = subprocess.run(["bash", str(ROOT / "examples" / "smollm2_h200.sh"), stage], cwd=ROOT, env=stage_env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, stage + done.stdout[-3000:] + done.stderr[-3000:]
    meta = json.loads((run / "data" / "train_sampled" / "meta.json").read_text())
    assert meta["settings"]["sampling"]["temperature"] == 1.0
    summary = json.loads((tmp_path / "mix" / "summary.json").read_text())
    greedy = json.loads((run / "summary.json").read_text())
    # every row read (a code request may not fit the test's 256-token max_length: skipped, counted)
    assert summary["steps"] == 3 and summary["data_rows"]["rows"] == 2 * greedy["data_rows"]["rows"] + 2, (summary, greedy)
    code = (run / "data" / "code_prompts" / "train_prompts.jsonl").read_text()
    assert code.count("Complete the following Python") == 2
