"""Fixtures for the generate tests: a tiny random target built offline and local servers.

The tiny target is a real Llama model (2 layers, width 64) saved to disk with the byte-level
tokenizer of tests/tiny.py and a ChatML template that knows `enable_thinking`, so the whole path
(load_target, chat template, left padding, generate, HTTP) runs in seconds on CPU, offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_train.generate.job import generate
from dflash_train.generate.config import build_generate_config
from tests.tiny import CHATML, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]

# tests/tiny.py's ChatML plus the `enable_thinking` switch of Qwen3-style templates.
CHATML_THINKING = CHATML.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}",
)


def build_tiny_target(path: Path) -> Path:
    """Save a random-init Llama (2 layers, width 64) with the byte-level tiny tokenizer to `path`."""
    tokenizer = tiny_tokenizer(CHATML_THINKING)
    tokenizer.eos_token = "<|im_end|>"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        initializer_range=0.5,  # the default 0.02 makes a random model repeat one token: proves nothing
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows may be dicts (JSON-encoded) or raw bytes/str lines (for malformed input)."""
    with path.open("wb") as f:
        for row in rows:
            line = row if isinstance(row, bytes) else (row if isinstance(row, str) else json.dumps(row)).encode()
            f.write(line + b"\n")
    return path


def read_rows(out_dir) -> list[dict]:
    """All committed rows of a Parquet output directory."""
    return [row for path in sorted(out_dir.glob("shard-*.parquet")) for row in pq.read_table(path).to_pylist()]


def run(tmp_path, inputs, urls, **settings) -> dict:
    """generate() over `inputs` into tmp_path/out against server `urls`; settings as dotted keys."""
    cfg = build_generate_config(
        {"inputs": [str(p) for p in inputs], "output_dir": str(tmp_path / "out"), "progress": False},
        {"http.server_urls": urls, **settings},
    )
    return generate(cfg)


def conversation(i: int, turns: int = 1) -> dict:
    """`turns` user/assistant pairs with id c<i>."""
    messages = []
    for t in range(turns):
        messages += [{"role": "user", "content": f"question {i}.{t}"}, {"role": "assistant", "content": "dataset answer"}]
    return {"id": f"c{i}", "messages": messages}
