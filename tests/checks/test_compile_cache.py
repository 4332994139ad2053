import os
from pathlib import Path

import pytest

from dflash_train.checks import compile_cache as cc

CACHE_VARS = (
    "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"
)


def test_key_follows_the_compiled_source(tmp_path):
    model, masks = tmp_path / "model.py", tmp_path / "masks.py"
    model.write_text("def forward(x):\n    return x\n")
    masks.write_text("MASK = 1\n")
    before = cc.cache_key([model, masks])
    assert cc.cache_key([masks, model]) == before  # order of the list does not matter
    model.write_text("def forward(x):\n    return x * 2  # a debug patch\n")
    assert cc.cache_key([model, masks]) != before


def test_key_tolerates_missing_sources(tmp_path):
    assert cc.cache_key([tmp_path / "absent.py"]) == cc.cache_key([])


def test_root_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "env"))
    assert cc.cache_root() == tmp_path / "env" / "compile"
    assert cc.cache_root(tmp_path / "cfg") == tmp_path / "cfg"
    monkeypatch.delenv("DFLASH_TRAIN_CACHE")
    assert cc.cache_root() == Path.home() / ".cache" / "dflash-train" / "compile"


@pytest.mark.parametrize("root", ["/tmp/dflash-cache", "/var/tmp/dflash-cache"])
def test_activate_refuses_volatile_roots(root):
    with pytest.raises(ValueError, match="/tmp"):
        cc.activate("k", root)
    assert not Path(root).exists()


def test_activate_points_inductor_and_triton_at_the_key(tmp_path, monkeypatch):
    for var in CACHE_VARS:  # registers the originals so monkeypatch restores them
        monkeypatch.setenv(var, "unset")
    key_dir = cc.activate("k1", tmp_path, allow_tmp=True)
    assert key_dir == tmp_path / "k1"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "k1" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "k1" / "triton")
    assert os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"
    assert (key_dir / "inductor").is_dir() and (key_dir / "triton").is_dir()


def test_state_cold_warm_stale_and_other_keys_survive(tmp_path):
    assert cc.cache_state("k1", tmp_path) == "cold"
    (tmp_path / "k1" / "inductor").mkdir(parents=True)
    (tmp_path / "k1" / "inductor" / "graph.bin").write_bytes(b"x" * 100)
    assert cc.cache_state("k1", tmp_path) == "cold"  # files alone do not prove a finished warm-up
    cc.mark_warm("k1", tmp_path, {"warmup_s": 42.0})
    assert cc.cache_state("k1", tmp_path) == "warm"
    assert cc.cache_state("k2", tmp_path) == "stale"
    cc.mark_warm("k2", tmp_path, {})
    listing = {c["key"]: c for c in cc.list_caches(tmp_path)}
    assert set(listing) == {"k1", "k2"}
    assert listing["k1"]["warm"] and listing["k1"]["info"]["warmup_s"] == 42.0
    assert listing["k1"]["size_bytes"] >= 100
    assert not list(tmp_path.rglob("*.tmp"))  # the atomic write left no temp file behind
