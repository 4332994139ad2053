"""Engines by name: the registries match the config's choices, `choose` picks, falls back or refuses
in one line; every decoder runs through one loop that hands on each row the round it finishes."""

import logging
import typing

import pytest
import torch

from dflash_train.decode.batched import ACCEPTANCE_AUTO, ACCEPTANCE_ENGINES, BatchedSpeculative, batched_speculative
from dflash_train.decode.engines import Engine, choose
from dflash_train.decode.rounds import decode_rows
from dflash_train.decode.spec_decode import OneRowSpeculative, TargetGreedy, speculative_generate, target_greedy
from dflash_train.decode.static_decode import StaticDecoder, StaticGreedy, StaticSpeculative
from dflash_train.eval.config import DecodeSettings
from dflash_train.eval.served_speed import SPEED_ENGINES, speed_auto

from tests.decode.test_batched import agreeing_target, prompts
from tests.eval.tiny_models import tiny_drafter


def _choices(field: str) -> set[str]:
    return set(typing.get_args(DecodeSettings.model_fields[field].annotation))


def test_the_registries_are_the_configs_choices():
    assert _choices("acceptance_cache") == {"auto", *ACCEPTANCE_ENGINES}
    assert _choices("speed_engine") == {"auto", *SPEED_ENGINES}
    assert set(ACCEPTANCE_AUTO) == set(ACCEPTANCE_ENGINES)


class _Target:
    name, device = "tiny", torch.device("cpu")


ENGINES = {
    "fast": Engine("fast", lambda target, temperature: "it decodes greedily only" if temperature else None,
                   fallback="plain"),
    "strict": Engine("strict", lambda target, temperature: "its layers are not supported"),
    "plain": Engine("plain"),
}


def test_choose_auto_takes_the_first_that_runs(caplog):
    assert choose(ENGINES, "auto", ("fast", "plain"), _Target(), 0.0, "decode.x").name == "fast"
    with caplog.at_level(logging.INFO, logger="dflash_train"):
        chosen = choose(ENGINES, "auto", ("fast", "plain"), _Target(), 0.7, "decode.x")
    assert (chosen.name, chosen.passed_over) == ("plain", "it decodes greedily only")
    assert "decode.x: not fast, since it decodes greedily only" in caplog.text


def test_choose_by_name_falls_back_said_as_an_error_or_refuses(caplog):
    with caplog.at_level(logging.ERROR, logger="dflash_train"):
        chosen = choose(ENGINES, "fast", ("fast",), _Target(), 0.7, "decode.x")
    assert (chosen.name, chosen.engine.run, chosen.passed_over) == ("plain", "plain", "it decodes greedily only")
    assert "decode.x=fast cannot run tiny: it decodes greedily only; using plain" in caplog.text
    with pytest.raises(ValueError, match=r"^decode.x=strict cannot run tiny: its layers are not supported$"):
        choose(ENGINES, "strict", ("plain",), _Target(), 0.0, "decode.x")
    with pytest.raises(ValueError, match=r"decode.x must be auto or one of \['fast', 'plain', 'strict'\], got 'fas'"):
        choose(ENGINES, "fas", ("plain",), _Target(), 0.0, "decode.x")


def test_speed_auto_is_static_on_a_gpu_only():
    assert speed_auto(_Target()) == ("eager",)
    gpu = _Target()
    gpu.device = torch.device("cuda")
    assert speed_auto(gpu) == ("static", "eager")


def test_each_row_is_handed_on_the_round_it_finishes():
    """decode_rows over the batched decoder: a row is released once, right after the round that
    ended it (its last acceptance length), and the results are batched_speculative's."""
    target = agreeing_target(eager=True)
    drafter = tiny_drafter(target, block_size=4)
    rows = prompts([1, 5, 12, 3, 7, 20])
    decoder = BatchedSpeculative(target, drafter, 24, {7, 100}, 0.0, 4, None, cached=True)
    rounds, released = [0], {}
    step = decoder.step
    decoder.step = lambda: (rounds.__setitem__(0, rounds[0] + 1), step())[1]
    results, seconds = decode_rows(decoder, rows, lambda row, result: released.setdefault(row, (rounds[0], result)))
    assert sorted(released) == list(range(len(rows))) and seconds >= 0
    for row, (at, result) in released.items():
        assert result is results[row] and at == len(result.acceptance_lengths)
    assert len({at for at, _ in released.values()}) > 1  # rows did end in different rounds
    expected = batched_speculative(target, drafter, rows, 24, [7, 100], batch_size=6, cached=True)
    assert [(r.tokens, r.acceptance_lengths) for r in results] == [(r.tokens, r.acceptance_lengths) for r in expected]


def test_every_decoder_answers_alike_through_the_one_loop():
    """The eager, batched and static decoders (speculative) and the eager and static target-alone
    ones, each through decode_rows, give the same greedy tokens in fp32."""
    target = agreeing_target(eager=False)
    drafter = tiny_drafter(target, block_size=4)
    rows = prompts([3, 9, 5])
    longest = max(map(len, rows)) + 16
    static = StaticDecoder(target, drafter, len(rows), longest, graphs=False, compile=False)
    answers = {
        "eager": [decode_rows(OneRowSpeculative(target, drafter, 16), [r])[0][0].tokens for r in rows],
        "eager target": [decode_rows(TargetGreedy(target, 16), [r])[0][0].tokens for r in rows],
        "batched": [r.tokens for r in decode_rows(BatchedSpeculative(target, drafter, 16, set(), 0.0, 4, None,
                                                                      cached=False), rows)[0]],
        "static": [r.tokens for r in decode_rows(StaticSpeculative(static, 16, set()), rows)[0]],
        "static target": [r.tokens for r in decode_rows(StaticGreedy(static, 16, set()), rows)[0]],
    }
    reference = [target_greedy(target, torch.tensor([r]), 16).tokens for r in rows]
    assert all(len(a) == 16 for a in reference)
    for name, got in answers.items():
        assert got == reference, name
    assert speculative_generate(target, drafter, torch.tensor([rows[0]]), 16).tokens == reference[0]
