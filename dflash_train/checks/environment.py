"""Facts about the Python environment and machine that decide training throughput.

Package metadata is read from an injectable list of paths (default sys.path) so the doctor can
inspect another environment, and tests can add a fabricated one, without importing anything.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

import torch
from packaging.utils import canonicalize_name

from dflash_train.pinned_memory import ALLOC_CONF_VARS

TRACKED_PACKAGES = ("torch", "triton", "transformers", "safetensors", "pydantic", "pyarrow", "torchao")
# Inference stacks pin their own torch/CUDA builds and kernels; they belong in a serving env.
# The slow run had sglang, vllm and flashinfer installed next to the trainer.
FOREIGN_PACKAGES = (
    "sglang", "vllm", "flashinfer", "flashinfer-python", "flashinfer-cubin", "lmdeploy",
    "tensorrt-llm", "tensorrt", "xformers", "sgl-kernel", "deepspeed-mii", "exllamav2",
)
_CUDA_SUFFIX = re.compile(r"-cu(\d+)$")


def _search_path(paths: list[str] | None) -> list[str]:
    """`paths` (default sys.path) without repeats: '' and the cwd would otherwise list a dist twice."""
    unique: dict[str, str] = {}
    for entry in sys.path if paths is None else paths:
        unique.setdefault(os.path.realpath(entry or "."), entry)
    return list(unique.values())


def installed(paths: list[str] | None = None) -> dict[str, list[str]]:
    """Canonical distribution name -> versions found on `paths` (a list: duplicates are a finding)."""
    found: dict[str, list[str]] = {}
    for dist in metadata.distributions(path=_search_path(paths)):
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonicalize_name(name), []).append(dist.version)
    return found


def package_versions(found: dict[str, list[str]]) -> dict[str, str | None]:
    """Tracked packages (None when absent) plus every foreign package that is present."""
    versions = {name: ",".join(found[name]) if name in found else None for name in TRACKED_PACKAGES}
    versions.update({name: ",".join(found[name]) for name in FOREIGN_PACKAGES if name in found})
    return versions


def foreign_packages(found: dict[str, list[str]]) -> list[str]:
    return [f"{name}=={','.join(found[name])}" for name in FOREIGN_PACKAGES if name in found]


def _installs_torch(dist: metadata.Distribution) -> bool:
    top_level = dist.read_text("top_level.txt")
    if top_level is not None:
        return "torch" in top_level.split()
    return any(str(f) == "torch/__init__.py" for f in dist.files or ())


def torch_installs(paths: list[str] | None = None) -> list[str]:
    """Every distribution that provides the `torch` package: two of them means two builds fight over it."""
    dists = metadata.distributions(path=_search_path(paths))
    return sorted(
        f"{d.metadata['Name']}=={d.version} in {d.locate_file('')}" for d in dists if _installs_torch(d)
    )


def cuda_runtime_majors(found: dict[str, list[str]]) -> dict[str, list[str]]:
    """CUDA major -> nvidia-* runtime wheels built for it (from the -cuNN suffix or the cuda-* version)."""
    majors: dict[str, list[str]] = {}
    for name, versions in found.items():
        if not name.startswith("nvidia-"):
            continue
        suffix = _CUDA_SUFFIX.search(name)
        if suffix:
            majors.setdefault(suffix.group(1), []).append(name)
        elif name.startswith(("nvidia-cuda-", "nvidia-cublas")):
            # CUDA 13 wheels dropped the suffix; their version is the CUDA toolkit version.
            majors.setdefault(versions[0].split(".")[0], []).append(name)
    return majors


def torch_build() -> dict:
    """The build, and the allocator settings it runs with (how host memory is pinned decides how
    fast the feature cache's host part fills: dflash_train/pinned_memory.py)."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"version": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn,
            "alloc_conf": {name: os.environ[name] for name in ALLOC_CONF_VARS if name in os.environ}}


def gpus() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append({"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                    "capability": f"{props.major}.{props.minor}"})
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_fingerprint(gpu_list: list[dict]) -> str:
    """What throughput is comparable across: GPU model x count, else CPU model x cores."""
    if gpu_list:
        names = sorted({g["name"] for g in gpu_list})
        return f"gpu:{len(gpu_list)}x{'+'.join(names)}"
    return f"cpu:{os.cpu_count()}x{cpu_model()}"


def credentials_present() -> dict[str, bool]:
    """Whether S3 and wandb credentials are configured. Booleans only: values never leave here."""
    home = Path.home()
    netrc = home / ".netrc"
    try:
        wandb_netrc = netrc.is_file() and "api.wandb.ai" in netrc.read_text()
    except OSError:
        wandb_netrc = False
    return {
        "s3": any(os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE"))
        or (home / ".aws" / "credentials").is_file(),
        "wandb": bool(os.environ.get("WANDB_API_KEY")) or wandb_netrc,
    }
