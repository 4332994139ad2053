import subprocess
from pathlib import Path

import pytest


def make_dist(site: Path, name: str, version: str, top_level: str | None = None) -> Path:
    """A minimal but real installed distribution (dist-info) that importlib.metadata finds."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if top_level is not None:
        (info / "top_level.txt").write_text(top_level + "\n")
    return info


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True, text=True, check=True,
    )
    return done.stdout


@pytest.fixture
def git_repo(tmp_path) -> Path:
    """A checkout shaped like this project with one committed drafter file."""
    repo = tmp_path / "repo"
    (repo / "dflash_train" / "draft").mkdir(parents=True)
    (repo / "dflash_train" / "draft" / "model.py").write_text("def forward(x):\n    return x\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "initial")
    return repo
