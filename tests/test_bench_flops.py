"""bench/flops.py, the numerator of the throughput benchmark's MFU, against torch's own count of the
matmuls a step runs (`FlopCounterMode`, on CPU): the target's feature forward and the drafter's
forward and backward with its loss. Attention is left out of that comparison (the counter prices a
masked SDPA as dense); its pairs are held to the dense mask in tests/draft/test_masks.py. And
`--recount` gives a record's MFU again from its rates."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import throughput  # noqa: E402

MATMULS = ("mm", "addmm", "bmm", "matmul")


def matmul_flops(counter: FlopCounterMode) -> int:
    return sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op).split(".")[-1] in MATMULS)


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_the_counted_matmuls_are_the_ones_a_step_runs(loss):
    args = throughput.parse_args(["--tiny", "--full-length", "--loss", loss])
    model, target, cfg, drafter = throughput.build_models(args, "tiny", 16, torch.device("cpu"), torch.float32)
    ids, loss_mask, lengths = throughput.make_batch("tiny", args.batch, 128, "cpu", torch.Generator().manual_seed(0), True)
    task = throughput.make_task(ids, loss_mask, cfg.objective, 0)
    flops = throughput.step_flops(model, drafter, cfg, lengths, task, ids.shape[1])
    layer_ids = throughput.stream_layer_ids(cfg, target)
    with FlopCounterMode(display=False) as counter:
        features = target.features(ids, layer_ids)
    assert matmul_flops(counter) == flops["target"]["linear"]
    mix = throughput.loss_mix(cfg.objective)
    with FlopCounterMode(display=False) as counter:
        out = throughput.draft_loss(drafter, task, features, target.embed_weight, target.lm_head_weight, False,
                                    4096, mix, target.logits)
        out.weighted_ce_sum.backward()
    # On a CPU the loss leaves rows of weight 0 out of the head's matmuls (no host sync to avoid
    # there); on a GPU every block token's row runs, which is what the count says
    rows = task.labels.numel()
    kept = int((task.weights > 0).sum())
    assert 0 < kept < rows
    assert matmul_flops(counter) == flops["drafter"]["linear"] + flops["drafter"]["lm_head"] // rows * kept
    assert flops["drafter"]["attention"] > 0 and flops["target"]["attention"] > 0


def test_recount_gives_a_records_mfu_from_its_rates(tmp_path):
    record = tmp_path / "run.json"
    ran = throughput.main(["--tiny", "--steps", "1", "--headline", "--out", str(record)])
    data = json.loads(record.read_text())
    data.update(matmul_tflops=100.0, flops_per_step={}, drafter_mfu=0.5)  # a GPU record of an older count
    record.write_text(json.dumps(data))
    again = throughput.main(["--tiny", "--steps", "1", "--recount", str(record)])
    assert again["flops_per_step"] == ran["flops_per_step"]
    seconds = ran["seq_tokens_per_step"] / ran["drafter_tokens_per_s"]
    drafter = sum(n for k, n in ran["flops_per_step"].items() if k.startswith("drafter_"))
    assert again["drafter_mfu"] == pytest.approx(drafter / seconds / 1e12 / 100.0)
    assert again["mfu_recounted_from"]["drafter_mfu"] == 0.5
    with pytest.raises(SystemExit, match="pass the flags of its run"):
        throughput.main(["--tiny", "--full-length", "--recount", str(record)])
