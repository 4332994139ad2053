"""On CUDA: target-only decoding of a SmolLM2-135M-shaped model (random weights, bf16) at batch 1,
its step captured as a CUDA graph of the eager kernels and of the compiled ones (torch.compile):
prints the tokens/s of both (the GPU run's figure for docs/benchmarks/speed.md) and requires the
compiled one to be faster. Run: `python -m pytest tests/gpu/test_compiled_steps_gpu.py -m gpu -s`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_train.decode.static_decode import StaticDecoder
from dflash_train.targets.model import Target

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from decode_speed import SMOLLM2  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT, NEW = 128, 256


def test_compiled_target_step_is_faster_at_batch_1():
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2, attn_implementation="sdpa"))
    model.to(torch.bfloat16).eval().requires_grad_(False)
    target = Target(model=model, tokenizer=None, name="smollm2-135m-shaped", device=torch.device("cuda"))
    prompt = torch.randint(0, SMOLLM2["vocab_size"], (PROMPT,)).tolist()
    rates, answers = {}, {}
    for compile in (False, True):
        t = time.perf_counter()
        decoder = StaticDecoder(target, None, rows=1, max_len=PROMPT + NEW, compile=compile)
        setup = time.perf_counter() - t
        assert decoder.steps.graphed, decoder.steps.graph_error
        assert decoder.steps.compiled == (["target"] if compile else []), decoder.steps.compile_error
        decoder.greedy([prompt], 16)  # warm-up
        out = decoder.greedy([prompt], NEW)
        answers[compile] = out.results[0].tokens
        rates[compile] = (len(answers[compile]) - 1) / out.decode_seconds
        print(f"target-only batch 1, {'compiled' if compile else 'uncompiled'}: {rates[compile]:.1f} tokens/s "
              f"({1e3 / rates[compile]:.3f} ms/step; compile + capture {setup:.1f} s)")
    same = next((i for i, (a, b) in enumerate(zip(answers[False], answers[True])) if a != b), len(answers[True]))
    print(f"compiled/uncompiled: {rates[True] / rates[False]:.2f}x; bf16 answers agree on the first {same} tokens")
    assert rates[True] > rates[False]
