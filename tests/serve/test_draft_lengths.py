"""The draft length that pays: parsing --draft-lengths, each length's figures, the best, the table."""

from __future__ import annotations

import pytest

from dflash_train.cli import build_parser
from dflash_train.errors import UserError
from dflash_train.serve.draft_lengths import (best_row, draft_lengths_for, format_rows, parse_draft_lengths,
                                              speed_row)
from dflash_train.serve.llama_server import Completion


def test_draft_lengths_parse_and_always_include_the_full_block():
    assert parse_draft_lengths("3,7,15") == (3, 7, 15)
    assert draft_lengths_for((7, 3, 3), 16) == [3, 7, 15]
    assert draft_lengths_for(None, 16) == [15]  # the default: today's single run


@pytest.mark.parametrize("text", ["3,,7", "a", "0,3", "3.5"])
def test_bad_draft_lengths_are_refused_in_one_line(text):
    with pytest.raises(ValueError) as err:
        parse_draft_lengths(text)
    assert "\n" not in str(err.value) and text in str(err.value)


def test_a_draft_longer_than_the_block_is_refused():
    with pytest.raises(UserError, match="20 is more than the drafter's block of 16 drafts"):
        draft_lengths_for((3, 20), 16)


def test_the_cli_reads_draft_lengths_and_device(capsys):
    parser = build_parser()
    args = parser.parse_args(["serve-check", "--target", "t", "--drafter", "d", "--draft-lengths", "1,3",
                              "--device", "cpu"])
    assert args.draft_lengths == (1, 3) and args.device == "cpu"
    assert parser.parse_args(["serve-check", "--target", "t", "--drafter", "d"]).device == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve-check", "--target", "t", "--drafter", "d", "--draft-lengths", "x"])
    assert "comma-separated whole numbers" in capsys.readouterr().err


def answer(tokens, seconds, steps=0, accepted=0):
    return Completion(tokens=tokens, seconds=seconds, drafted=steps * 3, accepted=accepted, steps=steps)


def test_a_row_splits_its_rounds_time_where_llama_cpp_timed_its_drafter():
    base = [answer([1, 2], 1.0)]
    spec = [answer([1, 2], 0.4, steps=2, accepted=1), answer([1, 2], 0.6, steps=2, accepted=1)]
    assert "round_ms" not in speed_row(3, spec, base)  # a log without the drafter's time
    for c, (calls, seconds) in zip(spec, [(2, 0.1), (3, 0.2)]):
        c.draft_calls, c.draft_seconds = calls, seconds
    row = speed_row(3, spec, base)
    assert row["round_ms"] == pytest.approx(1000 * 1.0 / 5) and row["drafting_ms"] == pytest.approx(1000 * 0.3 / 5)


def test_a_row_counts_speed_acceptance_and_losslessness():
    base = [answer([1, 2, 3, 4], 2.0), answer([5, 6], 1.0), answer([7, 8], 0.5)]  # 2, 2 and 4 tokens/s
    spec = [answer([1, 2, 3, 4], 0.5, steps=2, accepted=2), answer([5, 7], 1.0, steps=1, accepted=1),
            answer([7, 8], 0.25, steps=1, accepted=0)]  # 8, 2 and 8 tokens/s
    row = speed_row(3, spec, base)
    assert row["tokens_per_s"] == 8.0 and row["tokens_per_s_all_prompts"] == pytest.approx(8 / 1.75)
    assert row["speedup"] == pytest.approx(8.0 / 2.0)  # median prompt against median prompt
    assert row["mean_accepted_length"] == pytest.approx(1 + 3 / 4)
    # a round: 1.75 tokens at 8 tokens/s against a step of 1/2 s alone
    assert row["round_cost_target_steps"] == pytest.approx((1.75 / 8.0) / (1 / 2.0))
    assert row["lossless"] == {"matches": 2, "total": 3, "near_ties": 0}
    assert best_row([row]) is None and best_row([speed_row(3, spec, base, near_ties=1)])["draft_length"] == 3


def test_a_stalled_prompt_moves_the_median_little():
    """Another process on a 2-core machine held llama.cpp to 2 tokens/s for some prompts."""
    base = [answer([1] * 40, 1.0)] * 5
    spec = [answer([1] * 40, 0.8)] * 3 + [answer([1] * 40, 20.0)] * 2
    assert speed_row(1, spec, base)["speedup"] == pytest.approx(1.25)
    assert speed_row(1, spec, base)["tokens_per_s_all_prompts"] < 10


def row(length, rate, lossless=True):
    return {"draft_length": length, "tokens_per_s": rate, "mean_accepted_length": 1.5, "speedup": rate / 10,
            "lossless": {"matches": 2 if lossless else 1, "total": 2}}


def test_the_best_is_the_fastest_lossless_length():
    rows = [row(1, 11.0), row(3, 14.0), row(7, 20.0, lossless=False), row(15, 9.0)]
    assert best_row(rows)["draft_length"] == 3
    assert best_row([row(3, 12.0), row(1, 12.0)])["draft_length"] == 1  # a tie: the cheaper draft
    assert best_row([row(7, 20.0, lossless=False)]) is None


def test_the_table_has_a_line_per_length_and_names_the_best():
    rows = [row(1, 11.0), row(3, 14.0)]
    lines = format_rows(rows, best_row(rows), 10.0)
    assert len(lines) == 2 + len(rows) + 1
    # 1.5 tokens in 1.5 / 14 s, 1.07 steps of 1 / 10 s; no drafter time in the log
    assert lines[3].split() == ["3", "14.0", "1.500", "1.40x", "1.07", "n/a", "2/2"]
    timed = format_rows([row(3, 14.0) | {"round_ms": 107.14, "drafting_ms": 30.0}], None, 10.0)
    assert timed[2].split()[5:8] == ["30.00", "/", "107.14"] and "drafting ms / round ms" in timed[0]
    assert "median prompt" in lines[0] and lines[1].split()[:3] == ["target", "only", "10.0"]
    assert "best draft length: 3 (--spec-draft-n-max 3): 14.0 tokens/s" in lines[-1] and "1.40x" in lines[-1]
    assert "none" in format_rows([row(7, 20.0, lossless=False)], None, 10.0)[-1]
