"""examples/smollm2_h200.sh, the real-data chain of the SmolLM2 benchmark, keeps working: the same
script on CPU with a dozen prompts, a few answer tokens and three training steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow(seconds=220)
@pytest.mark.timeout(1200)  # the whole chain, three eval sets included: minutes on 2 loaded cores
def test_smollm2_example_runs_end_to_end_on_cpu(tmp_path):
    run = tmp_path / "run"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3 = this venv's
        "RUN": str(run), "DEVICE": "cpu", "NUM_PROMPTS": "10", "HELDOUT": "2", "ANSWER_TOKENS": "12", "BATCH": "8",
        # one prompt per eval set: a set's prefill is most of its eval (rows decoded together are
        # tests/eval/test_batched.py's and test_report.py's)
        "EVAL_BATCH": "2", "NEW_TOKENS": "6", "EVAL_PROMPTS": "1", "CURVE_PROMPTS": "1", "SPEEDUP_PROMPTS": "1",
        "EVERY_PROMPTS": "12", "CODE_PROMPTS": "2", "MULTI_PROMPTS": "2",
        # prompts of <= 200 characters (<= ~90 tokens): on CPU the target's prefill is the chain's cost,
        # and one prompt of 350 characters (145 tokens) doubled the width of a whole generate batch
        "MAX_CHARS": "200",
        # transformers' continuous engine sizes its CPU cache from free memory (14 GB RSS for two
        # prompts of ~300 tokens): the static engine here
        "ENGINE": "static",
        "TRAIN_ARGS": "target.dtype=auto train.time_budget_minutes=null train.max_steps=3 objective.num_anchors=4 data.length_bucket=0 "
                      "data.max_length=256 data.token_budget=256 checkpoint.every=2 train.compile=false train.compile_loss=false "
                      "train.compile_warmup_steps=1",  # nothing compiles: warmup's one step checks the stage runs
    }
    done = subprocess.run(["bash", str(ROOT / "examples" / "smollm2_h200.sh"), "all"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len((run / "data" / "heldout_prompts.jsonl").read_text().splitlines()) == 2
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert (run / "export" / "config.json").is_file()
    probe = [json.loads(line) for line in (run / "heldout.jsonl").read_text().splitlines()]
    assert [r["step"] for r in probe] == [3] and probe[0]["rows"] == 2  # the held-out answers, scored at the end
    # checkpoints at steps 2 and 3: eval-curve scores the earlier one (1/3 and 2/3 of the way both fall on it)
    expected = {"humaneval": 1, "sharegpt": 1, "mt-bench": 2, "humaneval_step_00000002": 1, "humaneval_speedup": 1}
    for name, turns in expected.items():
        report = json.loads((run / "eval" / name / "eval.json").read_text())
        assert report["num_turns"] == turns and report["lossless"] == {"matches": turns, "total": turns}, name
        assert (report["speedup"] is not None) == (name == "humaneval_speedup"), name

    # The training prompts: every user turn of the conversations, none of a held-out one's.
    every = [json.loads(line) for line in (run / "data" / "every" / "train_prompts.jsonl").read_text().splitlines()]
    heldout = {json.loads(line)["id"] for line in (run / "data" / "heldout_prompts.jsonl").read_text().splitlines()}
    assert len(every) == 12 and any("/turn" in p["id"] for p in every)
    assert not {p["id"].split("/turn")[0] for p in every} & heldout
    code = (run / "data" / "code_prompts" / "train_prompts.jsonl").read_text()
    assert code.count("Complete the following Python") == 2
    # two conversations of 2 turns (MULTI_TURNS), the second answered after the target's own first answer
    # (one `generate` answered the three prompt files into data/train)
    answers = [json.loads(line) for f in sorted((run / "data" / "train").glob("*.jsonl"))
               for line in f.read_text().splitlines()]
    multi = [r for r in answers if r["num_turns"] > 1]
    assert len(answers) == 16 and len(multi) == 2 and all(r["status"] == "ok" and r["num_turns"] == 2 for r in multi)
    greedy = json.loads((run / "summary.json").read_text())
    # every row read: 12 turns + 2 code answers + 2 conversations (a row that does not fit the test's
    # 256-token max_length would be skipped, and counted)
    assert greedy["data_rows"]["rows"] == 16, greedy
