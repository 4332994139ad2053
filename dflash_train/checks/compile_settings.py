"""torch.compile's process-wide settings: kept as they were across a library's set-up call, recorded
in the manifest, and kernel tuning named wherever it is on.

A quantisation library may tune inductor for its own kernels by changing `torch._inductor.config`
for the whole process. torchao's float8 inference quantisation (`target.fp8`) does so by default: it
turns on coordinate-descent tuning, and every graph compiled afterwards, the drafter's included,
then compiles and benchmarks many launch configurations of each Triton kernel. At the Qwen3-8B shape
the drafter's first step was still compiling after nine minutes
(docs/benchmarks/throughput.md#fp8). Our calls opt out of such settings; this guard makes a library
that changes them anyway fail at once, naming each setting, instead of slowing the run unseen.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from dflash_train.checks.compile_cache import CACHE_SWITCHES
from dflash_train.errors import UserError

_PLAIN = (bool, int, float, str, type(None))
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_", "TRITON_")
# Settings that make each compiled graph compile and benchmark many variants of its kernels
# (minutes a graph on a large drafter): off unless a run has measured that they pay.
KERNEL_TUNING = ("coordinate_descent_tuning", "max_autotune", "max_autotune_gemm", "max_autotune_pointwise")
_TORCH_DIR = Path(torch.__file__).parent


def _set_by_torch(name: str, value: str) -> bool:
    """torch itself points Triton at the ptxas it ships (its place in the package varies between
    releases), in whichever process compiles a kernel first: a run whose kernels all came from the
    cache has no such variable, so recording it would only show a cold run and a warm one apart."""
    return name == "TRITON_PTXAS_PATH" and Path(value).is_relative_to(_TORCH_DIR)


def settings_for_manifest() -> dict[str, dict]:
    """What a run's manifest records, so that `diff-runs` shows it: inductor's plain settings whose
    values differ from torch's defaults, and the environment variables that steer compilation (a
    setting a variable changes may show in either part). Left out: the cache folders, which differ
    between hosts, the cache switches every compiling run of this package sets
    (compile_cache.activate), and torch's own ptxas, which torch names in the environment itself."""
    # torch's own defaults (private, no public accessor): a value set back to its default is unchanged
    defaults = {name: entry.default for name, entry in inductor_config._config.items()}
    changed = {name: value for name, value in sorted(inductor_config.get_config_copy().items())
               if isinstance(value, _PLAIN) and value != defaults.get(name)}
    environment = {name: value for name, value in sorted(os.environ.items())
                   if name.startswith(_ENV_PREFIXES) and not name.endswith("_CACHE_DIR") and name not in CACHE_SWITCHES
                   and not _set_by_torch(name, value)}
    return {"inductor": changed, "environment": environment}


def kernel_tuning_on() -> list[str]:
    """The KERNEL_TUNING settings now on, however set (code or a TORCHINDUCTOR_* variable)."""
    return [name for name in KERNEL_TUNING if getattr(inductor_config, name)]


def _same(before: object, after: object) -> bool:
    try:
        if before == after:
            return True
    except Exception:  # an __eq__ that cannot compare: judge by kind alone
        pass
    # Snapshots are deep copies: two copies of an object without its own __eq__ differ by identity
    # only, and no change can be told from them but a change of kind (e.g. None -> a custom pass).
    return type(before) is type(after) and type(before).__eq__ is object.__eq__


@contextmanager
def compile_settings_kept(caller: str) -> Iterator[None]:
    """Run the block; raise a UserError (one line from the CLI) if it changed any of inductor's
    process-wide settings. `caller` names the block in the error."""
    before = inductor_config.get_config_copy()
    yield
    after = inductor_config.get_config_copy()
    changed = [f"{name}: {before.get(name)!r} -> {after.get(name)!r}" for name in sorted(before.keys() | after.keys())
               if not _same(before.get(name), after.get(name))]
    if changed:
        raise UserError(f"{caller} changed torch.compile's settings for the whole process ({'; '.join(changed)}), "
                        "which every graph compiled later would inherit; please report it with the library's version")
