from dflash_train.checks.doctor import run_doctor
from dflash_train.checks.gitstate import git_state

from .conftest import git


def _code_check(repo):
    return next(c for c in run_doctor(repo_root=repo).checks if c.name == "code")


def test_clean_checkout(git_repo):
    state = git_state(git_repo)
    assert state["commit"] == git(git_repo, "rev-parse", "HEAD").strip()
    assert state == {**state, "dirty": False, "diff_sha256": None, "changed_files": []}
    assert _code_check(git_repo).status == "ok"


def test_monkey_patch_in_model_code_is_reported_until_committed(git_repo):
    model = git_repo / "dflash_train" / "draft" / "model.py"
    model.write_text("import torch\ntorch.nn.functional.silu = lambda x: x  # debug\n")
    (git_repo / "dflash_train" / "draft" / "patch.py").write_text("PATCHED = True\n")
    state = git_state(git_repo)
    assert state["dirty"] and len(state["diff_sha256"]) == 64
    assert state["changed_files"] == ["dflash_train/draft/model.py", "dflash_train/draft/patch.py"]
    check = _code_check(git_repo)
    assert check.status == "warn" and "dflash_train/draft/model.py" in check.detail

    git(git_repo, "add", ".")
    git(git_repo, "commit", "-qm", "keep it")
    assert not git_state(git_repo)["dirty"]
    assert _code_check(git_repo).status == "ok"


def test_not_a_checkout_even_inside_another_repo(git_repo):
    nested = git_repo / "venv" / "site-packages"  # an installed package inside an unrelated repo
    nested.mkdir(parents=True)
    assert git_state(nested) is None
