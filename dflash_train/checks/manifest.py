"""The run manifest: everything needed to answer "what changed since the good run?".

Written once at start to `<run_dir>/manifest.json`. It records code (commit + diff digest),
environment (packages, torch build, GPUs), the resolved config and the command line, plus two
fingerprints the throughput guard uses to find comparable earlier runs. Environment variable
values never enter it: credentials appear only as booleans.
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform
import re
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path

from dflash_train.checks import environment as env
from dflash_train.atomic import write_json_atomic
from dflash_train.checks.gitstate import git_state

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1
# Keys that differ between otherwise identical runs; dotted paths into the config.
RUN_SPECIFIC_KEYS = ("run_dir", "seed", "tracking.run_name")
_SECRET_ARG = re.compile(r"(?i)^(--?)?([\w.-]*(key|secret|token|password)[\w.-]*)=.+$")


def config_fingerprint(config: dict, drop_keys: tuple[str, ...] | list[str] = RUN_SPECIFIC_KEYS) -> str:
    """sha256 of the config without run-specific keys: equal fingerprints = comparable workloads."""
    pruned = copy.deepcopy(config)
    for dotted in drop_keys:
        *parents, leaf = dotted.split(".")
        node = pruned
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return hashlib.sha256(json.dumps(pruned, sort_keys=True, default=str).encode()).hexdigest()


def redact_argv(argv: list[str]) -> list[str]:
    """Replace the value of `...key=`, `...token=`, `...secret=`, `...password=` arguments."""
    return [_SECRET_ARG.sub(r"\1\2=<redacted>", arg) for arg in argv]


def build_manifest(
    config: dict,
    argv: list[str],
    run_dir: str | Path,
    *,
    drop_keys: tuple[str, ...] | list[str] = RUN_SPECIFIC_KEYS,
    repo_root: str | Path | None = None,
    paths: list[str] | None = None,
    target: dict | None = None,
) -> dict:
    """Collect the manifest. `config` is the resolved config as plain data (model_dump(mode="json"));
    `target`: what was loaded (class, attention, text format: chat template or plain text)."""
    # inductor's import (~1.4 s): building a manifest needs it, `diff-runs` reading two does not
    from dflash_train.checks.compile_settings import settings_for_manifest

    found = env.installed(paths)
    gpu_list = env.gpus()
    return {
        "schema": SCHEMA_VERSION,
        "start_time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "run_dir": str(Path(run_dir).resolve()),
        "command": redact_argv(list(argv)),
        "git": git_state(repo_root),
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "packages": env.package_versions(found),
        "torch": env.torch_build(),
        "compile_settings": settings_for_manifest(),
        "gpus": gpu_list,
        "hardware_fingerprint": env.hardware_fingerprint(gpu_list),
        "config": config,
        "target": target,
        "config_fingerprint": config_fingerprint(config, drop_keys),
        "credentials": env.credentials_present(),
    }


def write_manifest(run_dir: str | Path, manifest: dict) -> Path:
    return write_json_atomic(Path(run_dir) / MANIFEST_NAME, manifest)
