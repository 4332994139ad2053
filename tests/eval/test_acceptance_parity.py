"""bench/acceptance_parity.py on tiny models: real slot-1 acceptance equals the teacher-forced
accuracy training measures, on the same tokens (a mask, label or feature shift would split them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from .test_export import save_checkpoint
from .tiny_models import tiny_drafter, tiny_target

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from acceptance_parity import main  # noqa: E402


@pytest.mark.slow(seconds=5)
def test_real_acceptance_equals_teacher_forced_accuracy(smollm2_tokenizer, tmp_path):
    target = tiny_target(vocab_size=49152, tokenizer=smollm2_tokenizer)
    with torch.no_grad():  # one dominant LM-head row: target and drafter each pick it about half the time
        target.model.lm_head.weight[100] *= 1000
    target.model.save_pretrained(tmp_path / "target")
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    ckpt = save_checkpoint(tiny_drafter(target, block_size=3, layer_ids=(1, 3)), tmp_path / "ckpt")
    result = main(["--target", str(tmp_path / "target"), "--drafter", str(ckpt), "--prompts", "mt-bench",
                   "--num-prompts", "3", "--max-new-tokens", "24"])
    assert result["rounds"] > 20 and 0 < result["real_slot1_acceptance"] < 1
    assert result["real_slot1_acceptance"] == result["teacher_forced_slot1_at_round_starts"]
