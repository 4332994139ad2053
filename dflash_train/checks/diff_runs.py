"""Compare two run manifests: every difference, the ones that usually explain a slowdown first."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_train.atomic import read_json
from dflash_train.checks.manifest import MANIFEST_NAME

ABSENT = "<absent>"
# Slowdowns have come from these; time and host differ between any two runs and go last.
RELEVANT_FIRST = ("packages", "torch", "compile_settings", "python", "git", "config", "gpus", "hardware_fingerprint")


def _flatten(obj: object, prefix: str, out: dict[str, object]) -> dict[str, object]:
    # Lists stay leaves: a GPU list or an argv reads better whole than element by element. An empty
    # dict has no leaves, so a setting added to one reads as that setting, not as the whole dict.
    if isinstance(obj, dict):
        for key, value in obj.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = obj
    return out


def _rank(key: str) -> tuple[int, str]:
    top = key.split(".", 1)[0]
    return (RELEVANT_FIRST.index(top) if top in RELEVANT_FIRST else len(RELEVANT_FIRST), key)


def diff_manifests(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(dotted key, value in a, value in b) for every leaf that differs; ABSENT marks a missing key."""
    flat_a, flat_b = _flatten(a, "", {}), _flatten(b, "", {})
    diffs = [
        (key, flat_a.get(key, ABSENT), flat_b.get(key, ABSENT))
        for key in set(flat_a) | set(flat_b)
        if flat_a.get(key, ABSENT) != flat_b.get(key, ABSENT)
    ]
    return sorted(diffs, key=lambda d: _rank(d[0]))


def _cell(value: object, width: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


def format_diff(diffs: list[tuple[str, object, object]], labels: tuple[str, str] = ("A", "B")) -> str:
    """A plain-text table: key | A | B. 'no differences' when the list is empty."""
    if not diffs:
        return "no differences"
    rows = [("key", *labels)] + [(k, _cell(a, 48), _cell(b, 48)) for k, a, b in diffs]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def diff_runs(run_dir_a: str | Path, run_dir_b: str | Path) -> str:
    """Read both `<run_dir>/manifest.json` and format their differences. ValueError if one is missing."""
    manifests = []
    for run_dir in (run_dir_a, run_dir_b):
        manifest = read_json(Path(run_dir) / MANIFEST_NAME)
        if manifest is None:
            raise ValueError(f"{run_dir}: no readable {MANIFEST_NAME}")
        manifests.append(manifest)
    return format_diff(diff_manifests(*manifests), labels=(str(run_dir_a), str(run_dir_b)))
