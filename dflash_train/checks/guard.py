"""Throughput guard: warn loudly, once, when a run is much slower than its best comparable run.

The motivating run fell from 21.5K to 4.3K tokens/s and nothing said so. Comparable = same config
fingerprint and same hardware fingerprint; the baseline is the best steady-state (post warm-up)
median of earlier runs under the same runs root. The warning names what it can see: recompiles,
a cold compile cache, an attention fallback, environment drift since the best run, dirty code.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

from dflash_train.atomic import read_json
from dflash_train.checks.diff_runs import diff_manifests
from dflash_train.checks.manifest import MANIFEST_NAME

METRICS_NAME = "metrics.jsonl"
_DRIFT_KEYS = ("packages", "torch", "compile_settings", "python", "git.commit", "git.diff_sha256")
logger = logging.getLogger("dflash_train")


@dataclass(frozen=True)
class Baseline:
    run_dir: Path
    tokens_per_s: float  # steady-state median
    manifest: dict
    attention_backend: str | None  # as recorded in its metrics, when it was


def _read_metrics(path: Path) -> list[dict]:
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a run killed mid-write leaves a truncated last line
        if isinstance(row, dict) and "step" in row and "tokens_per_s" in row:
            rows.append(row)
    return rows


def find_baseline(runs_root: str | Path, manifest: dict, warmup_steps: int) -> Baseline | None:
    """The earlier run with the same fingerprints and the highest post-warm-up median tokens/s."""
    own = Path(manifest.get("run_dir", "")).resolve() if manifest.get("run_dir") else None
    best = None
    for manifest_path in sorted(Path(runs_root).glob(f"*/{MANIFEST_NAME}")):
        run_dir = manifest_path.parent
        other = read_json(manifest_path)
        if other is None or run_dir.resolve() == own:
            continue
        if any(other.get(k) != manifest.get(k) for k in ("config_fingerprint", "hardware_fingerprint")):
            continue
        steady = [r for r in _read_metrics(run_dir / METRICS_NAME) if r["step"] > warmup_steps]
        if not steady:
            continue
        median = statistics.median(float(r["tokens_per_s"]) for r in steady)
        if best is None or median > best.tokens_per_s:
            best = Baseline(run_dir, median, other, steady[-1].get("attention_backend"))
    return best


class ThroughputGuard:
    """Create at run start; call `check` on every logged step."""

    def __init__(self, runs_root: str | Path, manifest: dict, warmup_steps: int, threshold: float = 0.7):
        if not 0 < threshold < 1:
            raise ValueError(f"throughput threshold must be in (0, 1), got {threshold}")
        self.manifest = manifest
        self.warmup_steps = warmup_steps
        self.threshold = threshold
        self.baseline = find_baseline(runs_root, manifest, warmup_steps)
        self._fired = False

    def check(self, step: int, tokens_per_s: float, context: dict | None = None) -> str | None:
        """The warning text the first time a post-warm-up step is below threshold x baseline, else None."""
        if self._fired or self.baseline is None or step <= self.warmup_steps:
            return None
        if tokens_per_s >= self.threshold * self.baseline.tokens_per_s:
            return None
        self._fired = True
        causes = self._causes(context or {})
        message = (
            f"THROUGHPUT DROP at step {step}: {tokens_per_s:,.0f} tokens/s is "
            f"{tokens_per_s / self.baseline.tokens_per_s:.0%} of the best comparable run "
            f"{self.baseline.run_dir} ({self.baseline.tokens_per_s:,.0f} tokens/s). Likely causes: "
            + ("; ".join(causes) if causes else "none visible")
            + f". Full comparison: dflash-train diff-runs {self.baseline.run_dir} "
            + str(self.manifest.get("run_dir", "<this run>"))
        )
        logger.warning(message)
        return message

    def _causes(self, context: dict) -> list[str]:
        causes = []
        recompiles = context.get("recompiles_since_warmup", 0)
        if recompiles:
            causes.append(f"{recompiles} recompile(s) since warm-up")
        cache_state = context.get("compile_cache_state")
        if cache_state not in (None, "warm"):
            causes.append(f"compile cache was {cache_state} at start")
        attention = _attention_cause(
            context.get("attention_backend"), self.baseline.attention_backend, bool(self.manifest.get("gpus"))
        )
        if attention:
            causes.append(attention)
        drift = [
            f"{key}: {old} -> {new}"
            for key, old, new in diff_manifests(self.baseline.manifest, self.manifest)
            if key.startswith(_DRIFT_KEYS)
        ]
        if drift:
            causes.append("environment/code changed since the best run (" + ", ".join(drift) + ")")
        git = self.manifest.get("git") or {}
        if git.get("dirty"):
            changed = ", ".join(git.get("changed_files") or []) or "outside the package"
            causes.append(f"uncommitted code changes: {changed}")
        return causes


def _attention_cause(backend: str | None, best_backend: str | None, on_gpu: bool) -> str | None:
    """Compare with the best run's recorded backend; without one, only a GPU run should be on flex."""
    if not backend:
        return None
    if best_backend:
        same = backend == best_backend
        return None if same else f"attention backend is {backend}, the best run used {best_backend}"
    return f"attention backend is {backend}, not flex (fallback?)" if on_gpu and backend != "flex" else None
