"""A thinking target through the whole chain, in both modes it can be served in: a tiny Qwen3 with
the real Qwen3 chat template; generate in process and through a server that returns the thinking
apart; train on those rows (rendered in the mode they were generated in, the thinking in the loss);
eval in the run's mode, recorded in its report, every answer the target's own greedy one."""

from __future__ import annotations

import json
import logging

import pytest
import yaml
from families import tiny_model
from tiny import tiny_tokenizer

from dflash_train.cli import main
from dflash_train.data.dataset import tokenize_files
from tests.data.test_reasoning import QWEN3, _learned
from tests.generate.conftest import read_rows, write_jsonl

PROMPTS = [f"q{i}: repeat after me, phrase number {i % 3}" for i in range(6)]


@pytest.mark.slow(seconds=15)
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_a_thinking_target_trains_and_evaluates_in_the_mode_it_is_served_in(tmp_path, start_server, capsys, caplog,
                                                                               thinking):
    caplog.set_level(logging.INFO, logger="dflash_train")
    tokenizer = tiny_tokenizer(QWEN3)
    model = tiny_model("qwen3")
    for config in (model.config, model.generation_config):
        config.eos_token_id, config.pad_token_id, config.bos_token_id = (
            tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id, None)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"p{i}", "messages": [{"role": "user", "content": p}]}
                                                       for i, p in enumerate(PROMPTS)])
    mode = "--thinking" if thinking else "--no-thinking"

    local = ["generate", "--backend", "local", "--model", str(tmp_path / "model"), "--input", str(prompts),
             "--out", str(tmp_path / "local"), "--max-tokens", "12", "--device", "cpu", "--no-progress", mode]
    assert main(local) == 0, capsys.readouterr().err[-2000:]
    assert json.loads((tmp_path / "local" / "meta.json").read_text())["settings"]["sampling"]["thinking"] is thinking

    server = start_server("--echo")  # answers apart from its thinking, as SGLang's and vLLM's reasoning parsers
    served = ["generate", "--input", str(prompts), "--out", str(tmp_path / "served"), "--no-progress", mode,
              f"http.server_urls=[{server.url}]"]
    assert main(served) == 0, capsys.readouterr().err[-2000:]
    rows = read_rows(tmp_path / "served")
    assert all(bool(r["messages"][1]["reasoning_content"]) is thinking for r in rows)
    ds = tokenize_files([tmp_path / "served"], tokenizer, 256, skip_invalid=False, workers=1)
    for row, ids, mask in zip(rows, ds.input_ids, ds.loss_mask):
        thought = f"<think>\n{row['messages'][1]['reasoning_content']}\n</think>\n\n" if thinking else ""
        assert _learned(tokenizer, ids.tolist(), mask.tolist()) == thought + row["messages"][1]["content"] + "<|im_end|>"

    run = {"run_dir": str(tmp_path / "run"), "seed": 0, "device": "cpu", "target": {"path": str(tmp_path / "model")},
           "draft": {"num_layers": 1, "target_layer_ids": [0, 2], "attention": "sdpa"},
           "objective": {"block_size": 4, "num_anchors": 8, "gamma": 4.0},
           "data": {"train_files": [str(tmp_path / "served"), str(tmp_path / "local")], "max_length": 128,
                    "token_budget": 512, "max_batch_size": 6},
           "train": {"lr": 3e-2, "warmup_ratio": 0.05, "log_every": 1, "max_steps": 10},
           "checkpoint": {"every": 10, "keep_last": 1}, "eval": {"prompts": str(prompts), "max_new_tokens": 12}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    assert main(["train", "-c", str(tmp_path / "run.yaml")]) == 0, capsys.readouterr().err[-2000:]
    assert f"with thinking {'on' if thinking else 'off'}, as they were generated" in caplog.text

    assert main(["eval", "-c", str(tmp_path / "run.yaml"), "--dtype", "float32", "--device", "cpu",
                 "--speed-prompts", "0", "--out", str(tmp_path / "eval")]) == 0, capsys.readouterr().err[-2000:]
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert report["thinking"] is thinking and report["lossless"] == {"matches": 6, "total": 6}
