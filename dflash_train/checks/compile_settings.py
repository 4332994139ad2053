"""torch.compile's process-wide settings, kept as they were across a library's set-up call.

A quantisation library may tune inductor for its own kernels by changing `torch._inductor.config`
for the whole process. torchao's float8 inference quantisation (`target.fp8`) does so by default: it
turns on coordinate-descent tuning, and every graph compiled afterwards, the drafter's included,
then compiles and benchmarks many launch configurations of each Triton kernel. At the Qwen3-8B shape
the drafter's first step was still compiling after nine minutes
(docs/benchmarks/throughput.md#fp8). Our calls opt out of such settings; this guard makes a library
that changes them anyway fail at once, naming each setting, instead of slowing the run unseen. The
settings a run starts with (an environment variable can set them too) go into its manifest.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch._inductor.config as inductor_config

from dflash_train.errors import UserError

_PLAIN = (bool, int, float, str, type(None))
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_", "TRITON_")
# Settings that make each compiled graph compile and benchmark many variants of its kernels
# (minutes a graph on a large drafter): off unless a run has measured that they pay.
KERNEL_TUNING = ("coordinate_descent_tuning", "max_autotune", "max_autotune_gemm", "max_autotune_pointwise")


def _plain_settings() -> dict[str, object]:
    """Inductor's settings of plain values (the flags and sizes a library would tune), by name."""
    return {name: value for name, value in inductor_config.get_config_copy().items() if isinstance(value, _PLAIN)}


def run_settings() -> dict[str, dict]:
    """What the manifest records, so that `diff-runs` shows it: inductor's plain settings whose
    values differ from torch's defaults (set by code), and the environment variables that steer
    compilation (an inductor default read from one, e.g. TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1,
    counts as a default in the first). Cache folders are left out: they differ between hosts."""
    # torch's own defaults (private, no public accessor): a value set back to its default is unchanged
    defaults = {name: entry.default for name, entry in inductor_config._config.items()}
    changed = {name: value for name, value in sorted(_plain_settings().items()) if value != defaults.get(name)}
    environment = {name: value for name, value in sorted(os.environ.items())
                   if name.startswith(_ENV_PREFIXES) and not name.endswith("_CACHE_DIR")}
    return {"inductor": changed, "environment": environment}


def kernel_tuning_on() -> list[str]:
    """The KERNEL_TUNING settings now on, however set (code or a TORCHINDUCTOR_* variable)."""
    return [name for name in KERNEL_TUNING if getattr(inductor_config, name)]


@contextmanager
def compile_settings_kept(caller: str) -> Iterator[None]:
    """Run the block; raise a UserError (one line from the CLI) if it changed any of inductor's
    process-wide settings. `caller` names the block in the error."""
    before = _plain_settings()
    yield
    after = _plain_settings()
    changed = [f"{name}: {before.get(name)!r} -> {value!r}" for name, value in after.items() if before.get(name) != value]
    if changed:
        raise UserError(f"{caller} changed torch.compile's settings for the whole process ({'; '.join(changed)}), "
                        "which every graph compiled later would inherit; please report it with the library's version")
