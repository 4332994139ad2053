"""`dflash-train doctor`: say, before a run starts, what would make it slow or wrong.

Every check maps to something that went wrong in a real run: foreign inference packages and a
second torch build in the env, code edited since the last commit, a cold or deleted compile cache.
Only conditions that make training impossible or meaningless fail (non-zero exit); the rest warn.
"""

from __future__ import annotations

import json
import shutil
import sys
import tomllib
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from dflash_train.config import RunConfig
from dflash_train.checks import compile_cache
from dflash_train.checks import environment as env
from dflash_train.checks.gitstate import git_state, package_repo_root

TORCH_FLOOR = Version("2.11")
MIN_PYTHON = (3, 11)
MIN_FREE_GIB = 20.0
_MARK = {"ok": " ok ", "warn": "WARN", "fail": "FAIL"}


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if any(c.status == "fail" for c in self.checks) else 0

    def to_json(self) -> str:
        return json.dumps({"exit_code": self.exit_code, "checks": [asdict(c) for c in self.checks]}, indent=2)


def format_report(report: DoctorReport) -> str:
    width = max((len(c.name) for c in report.checks), default=0)
    lines = [f"[{_MARK[c.status]}] {c.name.ljust(width)}  {c.detail}" for c in report.checks]
    counts = {s: sum(c.status == s for c in report.checks) for s in _MARK}
    lines.append(f"{counts['ok']} ok, {counts['warn']} warnings, {counts['fail']} failures")
    return "\n".join(lines)


def project_requirements(repo_root: Path) -> list[Requirement]:
    """Runtime dependencies: the installed distribution's metadata, else pyproject.toml in the repo."""
    try:
        texts = metadata.requires("dflash-train") or []
    except metadata.PackageNotFoundError:
        pyproject = repo_root / "pyproject.toml"
        if not pyproject.is_file():
            return []
        texts = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    reqs = [Requirement(t) for t in texts]
    # Extras carry an `extra == "..."` marker that is false for the base install.
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _first_version(found: dict[str, list[str]], name: str) -> Version | None:
    return Version(found[name][0]) if name in found else None


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    ok = sys.version_info[:2] >= MIN_PYTHON
    return Check("python", "ok" if ok else "fail", version if ok else f"{version} < 3.11 (required)")


def check_torch(found: dict[str, list[str]]) -> Check:
    version = _first_version(found, "torch")
    if version is None:
        return Check("torch", "fail", "not installed")
    if version < TORCH_FLOOR:
        return Check("torch", "fail", f"{version} < {TORCH_FLOOR} (floor)")
    build = env.torch_build()
    detail = f"{version} (CUDA {build['cuda'] or 'none'}, cuDNN {build['cudnn'] or 'none'})"
    return Check("torch", "ok", detail)


def check_pins(found: dict[str, list[str]], repo_root: Path) -> Check:
    problems = []
    for req in project_requirements(repo_root):
        version = _first_version(found, canonicalize_name(req.name))
        if version is None:
            problems.append(f"{req.name} missing (wants {req.specifier})")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name} {version} (wants {req.specifier})")
    if problems:
        return Check("pinned dependencies", "warn", "; ".join(problems))
    return Check("pinned dependencies", "ok", "all satisfied")


def check_triton(found: dict[str, list[str]], gpu_list: list[dict]) -> Check:
    if "triton" in found:
        return Check("triton", "ok", ",".join(found["triton"]))
    if gpu_list:
        return Check("triton", "warn", "not installed: torch.compile and flex_attention cannot run on GPU")
    return Check("triton", "ok", "not installed (not needed in CPU mode)")


def check_foreign(found: dict[str, list[str]]) -> Check:
    foreign = env.foreign_packages(found)
    if foreign:
        return Check(
            "foreign packages", "warn",
            f"{', '.join(foreign)}: inference stacks bring their own torch/CUDA pins and kernel "
            "patches; use a separate serving env",
        )
    return Check("foreign packages", "ok", "none of " + ", ".join(env.FOREIGN_PACKAGES[:4]) + ", ...")


def check_torch_installs(paths: list[str] | None) -> Check:
    installs = env.torch_installs(paths)
    if len(installs) > 1:
        return Check("torch installs", "fail", "more than one build provides `torch`: " + "; ".join(installs))
    return Check("torch installs", "ok", "one" if installs else "none found")


def check_cuda_runtimes(found: dict[str, list[str]]) -> Check:
    majors = env.cuda_runtime_majors(found)
    if len(majors) > 1:
        detail = "; ".join(f"CUDA {m}: {', '.join(sorted(names))}" for m, names in sorted(majors.items()))
        return Check("cuda runtimes", "warn", f"mixed CUDA runtime wheels ({detail})")
    return Check("cuda runtimes", "ok", f"CUDA {next(iter(majors))}" if majors else "no nvidia-* wheels")


def check_gpus(gpu_list: list[dict], config: RunConfig | None) -> Check:
    if gpu_list:
        listing = "; ".join(f"{g['name']} {g['memory_gib']} GiB sm{g['capability']}" for g in gpu_list)
        return Check("gpus", "ok", listing)
    wants_cuda = config is not None and config.device == "cuda"
    if wants_cuda:
        return Check("gpus", "warn", "no GPU visible but device=cuda")
    return Check("gpus", "ok", "no GPU: CPU mode")


def check_code(repo_root: Path) -> Check:
    state = git_state(repo_root)
    if state is None:
        return Check("code", "ok", f"{repo_root} is not a git checkout (installed package)")
    if not state["dirty"]:
        return Check("code", "ok", f"clean at {state['commit'][:12]}")
    changed = ", ".join(state["changed_files"]) or "outside dflash_train/"
    return Check("code", "warn", f"uncommitted changes vs {state['commit'][:12]}: {changed}")


def check_compile_cache(cache_root: str | Path | None, config: RunConfig | None) -> Check:
    key = compile_cache.cache_key()
    state = compile_cache.cache_state(key, cache_root)
    others = [c["key"] for c in compile_cache.list_caches(cache_root) if c["key"] != key]
    detail = f"{state} ({compile_cache.cache_root(cache_root)}/{key})"
    if others:
        detail += f"; other keys: {', '.join(others)}"
    if config is not None and not (config.train.compile or config.target.compile):
        return Check("compile cache", "ok", f"train.compile and target.compile are off; {detail}")
    return Check("compile cache", "ok" if state == "warm" else "warn", detail)


def check_kernel_tuning() -> Check:
    from dflash_train.checks.compile_settings import kernel_tuning_on  # imports inductor (seconds): this check alone needs it

    tuning = kernel_tuning_on()
    if tuning:
        return Check("kernel tuning", "warn", f"{', '.join(tuning)} on: every compiled graph tunes each kernel "
                     "(minutes a graph); unset the TORCHINDUCTOR_* variable unless a run has measured the gain")
    return Check("kernel tuning", "ok", "off (inductor's default heuristics)")


def check_credentials(config: RunConfig | None) -> Check:
    present = env.credentials_present()  # booleans only, by construction
    detail = ", ".join(f"{k}: {'present' if v else 'absent'}" for k, v in present.items())
    needs_s3 = config is not None and config.checkpoint.remote is not None
    needs_wandb = config is not None and config.tracking.backend == "wandb"
    missing = (needs_s3 and not present["s3"]) or (needs_wandb and not present["wandb"])
    return Check("credentials", "warn" if missing else "ok", detail)


def check_disk(run_dir: Path) -> Check:
    probe = run_dir.resolve()
    while not probe.exists():  # the run dir is usually created later: measure its nearest ancestor
        probe = probe.parent
    free_gib = shutil.disk_usage(probe).free / 2**30
    status = "ok" if free_gib >= MIN_FREE_GIB else "warn"
    return Check("disk", status, f"{free_gib:.1f} GiB free at {probe}")


def run_doctor(
    config: RunConfig | None = None,
    repo_root: str | Path | None = None,
    *,
    paths: list[str] | None = None,
    cache_root: str | Path | None = None,
) -> DoctorReport:
    """Run every check. `paths` is where packages are looked up (default sys.path)."""
    repo = Path(repo_root) if repo_root is not None else package_repo_root()
    found = env.installed(paths)
    gpu_list = env.gpus()
    run_dir = Path(config.run_dir) if config is not None else Path.cwd()
    return DoctorReport([
        check_python(),
        check_torch(found),
        check_pins(found, repo),
        check_triton(found, gpu_list),
        check_foreign(found),
        check_torch_installs(paths),
        check_cuda_runtimes(found),
        check_gpus(gpu_list, config),
        check_code(repo),
        check_compile_cache(cache_root, config),
        check_kernel_tuning(),
        check_credentials(config),
        check_disk(run_dir),
    ])
