"""What code is actually running: commit, dirty flag, a digest of the diff, files changed in the package.

A debug monkey-patch left in model code cost the motivating run most of its throughput and no record
showed it. Recording the digest of `git diff HEAD` lets two runs prove they ran the same code.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

PACKAGE_DIR = "dflash_train"


def package_repo_root() -> Path:
    """The directory that holds the `dflash_train` package (a git checkout when developing)."""
    return Path(__file__).resolve().parent.parent.parent


def _git(repo: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, check=False, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode(errors="replace") if done.returncode == 0 else None


def git_state(repo_root: str | Path | None = None) -> dict | None:
    """commit, dirty, diff_sha256 and changed_files (under dflash_train/, incl. untracked) or None.

    None when `repo_root` is not itself the top of a git checkout: an installed package inside
    some unrelated repository (a venv in a project folder) must not report that repo's state.
    """
    repo = Path(repo_root).resolve() if repo_root is not None else package_repo_root()
    top = _git(repo, "rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != repo:
        return None
    commit = _git(repo, "rev-parse", "HEAD")
    diff = _git(repo, "diff", "HEAD", "--no-color", "--no-ext-diff") or ""
    changed = (_git(repo, "diff", "HEAD", "--name-only", "--", PACKAGE_DIR) or "").split()
    untracked = (_git(repo, "ls-files", "--others", "--exclude-standard", "--", PACKAGE_DIR) or "").split()
    changed_files = sorted(set(changed) | set(untracked))
    return {
        "commit": commit.strip() if commit else None,
        # Untracked files elsewhere (run dirs, notes) do not change what runs; ones in the package do.
        "dirty": bool(diff) or bool(untracked),
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
        "changed_files": changed_files,
    }
