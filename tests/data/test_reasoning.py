"""Thinking targets: each assistant turn is learned as the target wrote it, its thinking included,
after the conversation as the target saw it then, checked turn by turn against the real Qwen3 chat
template's own rendering (`apply_chat_template`), which drops the thinking of past turns.

tests/data/templates/qwen3.jinja is the chat template of Qwen3-0.6B's tokenizer_config.json, as
llama.cpp ships it in models/templates/Qwen-Qwen3-0.6B.jinja."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dflash_train.data.chat import tokenize_conversation
from dflash_train.data.dataset import tokenize_files
from dflash_train.data.formats import DataError, normalise_messages
from tiny import CHATML, tiny_tokenizer

QWEN3 = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text()

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "Two plus two makes four."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6.", "reasoning_content": "Three and three: six."},
    {"role": "user", "content": "Thanks. Bye?"},
    {"role": "assistant", "content": "Bye!", "reasoning_content": "A farewell is due."},
]


def _rows(tok, messages, **kwargs) -> list[tuple[list[int], list[int]]]:
    got = tokenize_conversation(tok, messages, max_length=4096, template_kwargs=kwargs)
    return [(t.input_ids, t.loss_mask) for t in (got, *got.turns)]


def _learned(tok, ids, mask) -> str:
    return tok.decode([t for t, m in zip(ids, mask) if m], clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("thinking", [True, False])
def test_every_turn_is_learned_as_the_target_wrote_it_after_what_it_saw(thinking):
    tok = tiny_tokenizer(QWEN3)
    kwargs = {} if thinking else {"enable_thinking": False}
    messages = CONVERSATION if thinking else [{k: v for k, v in m.items() if k != "reasoning_content"}
                                              for m in CONVERSATION]
    rows = _rows(tok, messages, **kwargs)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(rows) == len(turns)  # the whole conversation (its last turn), then a row per earlier turn
    learned = {}
    for ids, mask in rows:
        text = tok.decode(ids, clean_up_tokenization_spaces=False)
        learned[text] = _learned(tok, ids, mask)
    for i in turns:
        # What the target saw: the template's own rendering of the conversation before turn i (past
        # thinking dropped), with the generation prompt of the mode it is served in.
        prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True, **kwargs)
        m = messages[i]
        wrote = (f"<think>\n{m['reasoning_content']}\n</think>\n\n" if thinking else "") + m["content"] + "<|im_end|>"
        assert prompt.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))
        row = next(text for text in learned if text.startswith(prompt + wrote))
        assert learned[row] == wrote, (i, learned[row])
    whole = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    assert whole in learned and "Two plus two" not in whole  # the template dropped past thinking there


def test_a_template_that_cannot_show_the_thinking_is_refused_naming_the_row():
    with pytest.raises(DataError, match=r"row 3: the chat template does not render the thinking \(reasoning_content\) "
                                        "of assistant turn 2"):
        tokenize_conversation(tiny_tokenizer(CHATML), CONVERSATION, max_length=4096, where="row 3")


def test_rows_keep_the_thinking_under_each_engines_name():
    for key in ("reasoning_content", "reasoning", "thinking"):
        row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", key: "hm"}]}
        assert normalise_messages(row, "f:1")[1] == {"role": "assistant", "content": "a", "reasoning_content": "hm"}
    blank = {"messages": [{"role": "user", "content": "q", "reasoning_content": None},
                          {"role": "assistant", "content": "a", "reasoning_content": " "}]}
    assert normalise_messages(blank, "f:1") == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(DataError, match=r"f:1: messages\[0\]: reasoning text belongs to an assistant turn"):
        normalise_messages({"messages": [{"role": "user", "content": "q", "reasoning_content": "x"}]}, "f:1")


def test_prepared_data_holds_every_turn_as_a_row(tmp_path):
    """Through the data path: one conversation, three rows, each turn's thinking in the loss."""
    tok = tiny_tokenizer(QWEN3)
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    ds = tokenize_files([src], tok, 4096, skip_invalid=False, workers=1)
    assert len(ds) == 3 and ds.stats.ok == 3
    learned = [_learned(tok, ids.tolist(), np.asarray(mask).tolist()) for ids, mask in zip(ds.input_ids, ds.loss_mask)]
    assert sorted(learned) == sorted(f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}<|im_end|>"
                                     for m in CONVERSATION if m["role"] == "assistant")
