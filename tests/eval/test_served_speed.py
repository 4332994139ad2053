"""Answer differences and their near-tie check, against hand-built answers."""

import torch

from dflash_train.eval.served_speed import NEAR_TIE_RELATIVE, answer_differences, first_difference, served_speed

from tests.decode.test_spec_decode import prompt


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_answer_differences_report_the_targets_top2_at_the_first_difference(target):
    p = prompt(5, target.vocab_size, seed=1)[0].tolist()
    logits = target.model(input_ids=torch.tensor([p + [7]])).logits[0, -1]
    top = logits.topk(2)
    runner_up = int(top.indices[1])
    report = answer_differences(target, [p, p, p], [[7, 8], [7, runner_up], [7]],
                                [[7, 8], [7, int(top.indices[0])], [7, 9]])
    assert report["answers"] == 3 and report["differ"] == 2
    tie, early_stop = report["first_differences"]
    assert tie["prompt"] == 1 and tie["index"] == 1 and tie["token"] == runner_up
    assert tie["top2"] == top.indices.tolist()
    assert abs(tie["gap"] - float(top.values[0] - top.values[1])) < 1e-5
    assert tie["near_tie"] == (tie["relative_gap"] < NEAR_TIE_RELATIVE)
    assert early_stop == {"prompt": 2, "index": 1, "token": None, "reference_token": 9}


def test_served_speed_batches_rows(target, drafter):
    prompts = [prompt(n, target.vocab_size, seed=n)[0].tolist() for n in (3, 7, 5)]
    report = served_speed(target, drafter, prompts, 10, rows=2, block_size=4)
    assert report["rows"] == 2 and report["speed_prompts"] == 3 and report["graphs"] is False
    assert report["differences"]["differ"] == 0 and report["tau"] >= 1 and report["speedup"] > 0
