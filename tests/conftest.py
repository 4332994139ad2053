"""Make `tests/` importable (`from tiny import tiny_target`) however pytest is invoked."""

import os
import sys
from pathlib import Path

import torch

# Tiny shapes: one intra-op thread is faster, and on a shared 2-core machine two spinning OpenMP
# threads made a 30 ms train step take 1.5 s.
torch.set_num_threads(1)

# Without a CUDA GPU, Triton kernels run in Triton's interpreter (numpy on the CPU), chosen before
# triton is first imported (its own helpers are built then): tests/draft/test_grouped_conv_kernel.py.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = Path(__file__).resolve().parent
# The embedded SmolLM2 is converted from GGUF once (~25 s): keep it in the checkout (git-ignored).
os.environ.setdefault("DFLASH_TRAIN_CACHE", str(TESTS.parent / ".cache" / "dflash-train"))
REPO = TESTS.parent
for path in (TESTS, TESTS.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


import json  # noqa: E402
import subprocess  # noqa: E402
import urllib.request  # noqa: E402

import pytest  # noqa: E402


def _seconds(item) -> float:
    slow = item.get_closest_marker("slow")
    return slow.kwargs["seconds"] if slow else 0


def pytest_collection_modifyitems(config, items):
    """Longest first (stable order otherwise), by the `slow(seconds=...)` markers: with two workers
    handed one test at a time (the README's `-n 2 --maxschedchunk 1`), the longest start first on
    either worker and the quick ones fill in around them, instead of one worker ending alone on a
    minute-long test. In a fresh clone this also starts the other SmolLM2 tests after the example
    (first) has converted it from GGUF (~45 s), rather than idle, waiting for its lock."""
    items.sort(key=_seconds, reverse=True)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers already fill both cores: the processes the tests start (launches, the example's
    # stages) get one thread each, not two that fight the other worker.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _conversations(n: int) -> list[dict]:
    """Learnable answers: a few fixed phrases, so a tiny drafter's loss falls within a few dozen steps."""
    phrases = ["the answer is forty two.", "abcabcabc abcabcabc", "hello there, general kenobi"]
    return [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"q{i % 7}: say phrase {i % 3}"},
                {"role": "assistant", "content": phrases[i % 3] + f" ({i % 5})"},
            ],
        }
        for i in range(n)
    ]


@pytest.fixture(scope="session")
def shared_tiny_target():
    """One frozen tiny Qwen3 target for the whole session (never trained, so safe to share)."""
    from tiny import tiny_target

    target = tiny_target(num_layers=4, hidden=64)
    # HF's std-0.02 init gives a head whose logits barely move: CE cannot fall in a few dozen steps.
    target.lm_head_weight.mul_(20)
    return target


@pytest.fixture
def make_run_config(tmp_path):
    """make_run_config(name, **overrides) -> RunConfig of a tiny CPU fp32 run on JSONL conversations."""
    from dflash_train.config import build_config

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in _conversations(24)))

    def make(name: str = "run", overrides: list[str] = ()):
        tree = {
            "run_dir": str(tmp_path / name),
            "seed": 0,
            "device": "cpu",
            "draft": {"num_layers": 1, "target_layer_ids": [0, 2], "attention": "sdpa"},
            "objective": {"block_size": 4, "num_anchors": 8, "gamma": 4.0, "ce_chunk_size": 16},
            "data": {"train_files": [str(data)], "max_length": 96, "token_budget": 192, "max_batch_size": 4},
            "train": {"lr": 3e-3, "warmup_ratio": 0.1, "log_every": 1, "epochs": 1},
            "checkpoint": {"every": 1000, "keep_last": 3},
        }
        return build_config(tree, overrides=list(overrides))

    return make


class Server:
    def __init__(self, *args: str):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "chat_server.py"), "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )
        line = self.proc.stdout.readline()
        assert line.startswith("READY "), f"server did not start: {line!r}"
        self.url = line.split()[1]

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/stats") as resp:
            return json.load(resp)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def start_server():
    """start_server(*args) -> Server running `python bench/chat_server.py --port 0 *args`."""
    servers: list[Server] = []

    def start(*args: str) -> Server:
        servers.append(Server(*args))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
