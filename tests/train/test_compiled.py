"""A run that compiles says so, at once, when kernel tuning is on: every graph it compiles would tune
each kernel (what torchao's FP8 quantisation once switched on unseen: docs/benchmarks/throughput.md)."""

from __future__ import annotations

import logging

import pytest
import torch._inductor.config as inductor_config

from dflash_train.train.compiled import Compilation


@pytest.mark.parametrize("tuning", [False, True])
def test_a_compiling_run_warns_when_kernel_tuning_is_on(make_run_config, caplog, tuning):
    cfg = make_run_config(overrides=["target.compile=true"])  # compiles (the target), on CPU
    with inductor_config.patch(coordinate_descent_tuning=tuning), caplog.at_level(logging.WARNING, "dflash_train"):
        compilation = Compilation.for_run(cfg, drafter=None, use_flex=False)
    assert compilation.cache_key is not None
    warned = [r.getMessage() for r in caplog.records if "tunes each of its kernels" in r.getMessage()]
    assert warned == (["coordinate_descent_tuning on: every graph this run compiles tunes each of its kernels, "
                       "minutes a graph (`dflash-train doctor`)"] if tuning else [])
