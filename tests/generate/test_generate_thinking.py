"""Thinking mode through generate and the data path: a server that returns the thinking apart, the
rows that keep it, and training text rendered in the mode the answers were generated in."""

from __future__ import annotations

import pytest

from dflash_train.data.dataset import tokenize_files
from dflash_train.data.formats import DataError
from dflash_train.generate.config import build_generate_config
from dflash_train.generate.job import generate
from tests.data.test_reasoning import QWEN3, _learned
from tests.generate.conftest import read_rows, write_jsonl
from tiny import tiny_tokenizer


@pytest.mark.parametrize("thinking", [True, False])
def test_generated_answers_are_rendered_in_the_mode_they_were_generated_in(tmp_path, start_server, thinking):
    """generate through a server that returns the thinking apart (`reasoning_content`), then the data
    path: the rows hold the thinking, and the training text is the prompt the target was served
    (Qwen3's non-thinking prompt ends in an empty think block) followed by what it wrote."""
    server = start_server("--echo")
    inputs = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": f"hello there {i}"}]}
                                                 for i in range(3)])
    out = tmp_path / "out"
    generate(build_generate_config({"inputs": [str(inputs)], "output_dir": str(out), "progress": False,
                                    "sampling": {"thinking": thinking}}, {"http.server_urls": [server.url]}))
    rows = read_rows(out)
    assert [r["messages"][1]["reasoning_content"] for r in rows] == (["The user wrote 3 words."] * 3 if thinking
                                                                     else [None] * 3)
    tok = tiny_tokenizer(QWEN3)
    ds = tokenize_files([out], tok, 4096, skip_invalid=False, workers=1)
    for row, ids, mask in zip(rows, ds.input_ids, ds.loss_mask):
        text = tok.decode(ids.tolist(), clean_up_tokenization_spaces=False)
        answer = row["messages"][1]["content"]
        wrote = (f"<think>\nThe user wrote 3 words.\n</think>\n\n{answer}<|im_end|>" if thinking
                 else f"{answer}<|im_end|>")
        served = tok.apply_chat_template(row["messages"][:1], tokenize=False, add_generation_prompt=True,
                                         enable_thinking=thinking)
        assert text.startswith(served + wrote) and _learned(tok, ids.tolist(), mask.tolist()) == wrote
    with pytest.raises(DataError, match=rf"data.chat_template_kwargs.enable_thinking={not thinking}, but {out} was "
                                        rf"generated with thinking {'on' if thinking else 'off'} \(its meta.json\)"):
        tokenize_files([out], tok, 4096, skip_invalid=False, template_kwargs={"enable_thinking": not thinking})
