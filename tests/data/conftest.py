"""Fixtures for the generate tests: a tiny random target built offline and local servers.

The tiny target is a real Llama model (2 layers, width 64) with a byte-level BPE tokenizer trained
here on a few sentences and a ChatML template that knows `enable_thinking`, so the whole path
(chat template, left padding, generate, HTTP) runs in seconds on CPU without downloading anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DFLASH_TRAIN_CACHE", "/work/.cache-dflash")
REPO = Path(__file__).resolve().parents[2]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts a block of tokens and the target verifies them in one pass.",
    "Hello there! How are you today? Tell me about the weather, numbers 0123456789 and code: def f(x): return x",
] * 20


def build_tiny_target(path: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, initializer_range=0.5,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


class Server:
    def __init__(self, *args: str):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_train.data.server", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )
        line = self.proc.stdout.readline()
        assert line.startswith("READY "), f"server did not start: {line!r}"
        self.url = line.split()[1]

    def stats(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.url + "/stats") as resp:
            return json.load(resp)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def start_server():
    """start_server(*args) -> Server running `python -m dflash_train.data.server --port 0 *args`."""
    servers: list[Server] = []

    def start(*args: str) -> Server:
        servers.append(Server(*args))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows may be dicts (JSON-encoded) or raw bytes/str lines (for malformed input)."""
    with path.open("wb") as f:
        for row in rows:
            line = row if isinstance(row, bytes) else (row if isinstance(row, str) else json.dumps(row)).encode()
            f.write(line + b"\n")
    return path
