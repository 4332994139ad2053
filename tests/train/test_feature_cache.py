"""The feature cache's two parts: rows past the device's room are kept in host memory and read back
bit for bit; past the host's room too they are made again. Checked against the rows themselves and
a brute-force padded batch; the host's room read from meminfo and cgroup files."""

from __future__ import annotations

import pytest
import torch

from dflash_train.train import feature_cache
from dflash_train.train.feature_cache import FeatureCache, HostSlabs, host_room

from train.helpers_cache import Rows, epoch_batches, reference  # tests/ is on sys.path (conftest.py)

GIB = 2**30


def epoch(cache: FeatureCache, rows: Rows, length: int = 16) -> None:
    for batch in epoch_batches(len(rows.rows), 3, length):
        assert torch.equal(cache.features(batch, rows), reference(rows.rows, batch["indices"], length))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rows_past_the_device_are_kept_in_host_slabs_and_read_back_exactly(monkeypatch, caplog, dtype):
    monkeypatch.setattr(feature_cache, "SLAB_BYTES", 256)  # several rows a slab, several slabs
    clock = iter(range(0, 1000, 2))  # every slab's allocation takes 2 s on this clock
    monkeypatch.setattr(feature_cache, "perf_counter", lambda: next(clock))
    lengths = [5, 16, 1, 9, 13, 7, 2, 11, 16, 3]
    rows = Rows(lengths, width=6, dtype=dtype)
    cache = FeatureCache(torch.device("cpu"), host=HostSlabs(pin=False, room=lambda: GIB), expected_rows=len(lengths))
    room = iter([True])  # the first batch fits on the device, then it is full
    cache.has_room = lambda nbytes: next(room, False)
    with caplog.at_level("INFO", logger="dflash_train"):
        for _ in range(3):
            epoch(cache, rows)
    # said once, when the last row is kept: where the rows went and what pinning the slabs cost
    kept = [r.getMessage() for r in caplog.records if "every row kept" in r.getMessage()]
    slabs = len(cache.host.slabs)
    assert kept == [f"feature cache: every row kept: 3 rows on the device, 7 in host memory (0.0 GiB in "
                    f"{slabs} slabs, pinned in {2.0 * slabs:.1f} s)"]
    assert sorted(rows.asked) == list(range(len(lengths)))  # every row made once, over three epochs
    assert cache.on_host == len(lengths) - 3 and len(cache) == len(lengths)
    assert len(cache.host.slabs) > 1
    for i in range(3, len(lengths)):  # host rows: views into the slabs, 64-byte aligned
        kept = cache.rows[i]
        assert any(kept.untyped_storage().data_ptr() == s.untyped_storage().data_ptr() for s in cache.host.slabs)
        assert kept.data_ptr() % 64 == 0


@pytest.mark.parametrize("stop", ["room", "limit"])
def test_past_the_hosts_room_or_limit_the_rest_is_made_again_every_epoch(monkeypatch, stop):
    monkeypatch.setattr(feature_cache, "SLAB_BYTES", 512)
    rows = Rows([8] * 12, width=6, dtype=torch.float32)  # 192 bytes a row: two rows a slab
    slabs_left = iter([512] * 3)  # three slabs, then the host keeps only its reserve
    host = (HostSlabs(pin=False, room=lambda: next(slabs_left, 0)) if stop == "room" else
            HostSlabs(pin=False, limit=3 * 512, room=lambda: GIB))
    cache = FeatureCache(torch.device("cpu"), host=host)
    cache.has_room = lambda nbytes: False  # nothing on the device
    epoch(cache, rows)
    assert cache.on_host == 6 and host.full and len(host.slabs) == 3
    rows.asked.clear()
    epoch(cache, rows)
    assert rows.asked == list(range(6, 12))  # only the rows cached nowhere


def test_a_row_larger_than_a_slab_gets_a_slab_of_its_own_rounded_to_a_power_of_two(monkeypatch):
    monkeypatch.setattr(feature_cache, "SLAB_BYTES", 64)
    host = HostSlabs(pin=False, room=lambda: GIB)
    row = torch.randn(10, 30)  # 1,200 bytes
    assert torch.equal(host.keep(row), row) and host.nbytes == 2048


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_host_room_reads_meminfo_and_the_cgroup_limit(tmp_path):
    meminfo = write(tmp_path / "meminfo", "MemTotal:       100000000 kB\nMemFree: 1 kB\nMemAvailable:    60000000 kB\n")
    total, available = 100_000_000 * 1024, 60_000_000 * 1024
    reserve = feature_cache.HOST_RESERVE_GIB * GIB + total // 10
    no_cgroup = tmp_path / "none"
    assert host_room(meminfo, no_cgroup) == available - reserve
    v2 = tmp_path / "v2"
    write(v2 / "memory.max", "max\n"), write(v2 / "memory.current", "5\n")
    assert host_room(meminfo, v2) == available - reserve  # no limit
    write(v2 / "memory.max", f"{40 * GIB}\n"), write(v2 / "memory.current", f"{10 * GIB}\n")
    assert host_room(meminfo, v2) == 30 * GIB - reserve  # the container's limit is the smaller room
    v1 = tmp_path / "v1"
    write(v1 / "memory/memory.limit_in_bytes", f"{20 * GIB}\n"), write(v1 / "memory/memory.usage_in_bytes", f"{GIB}\n")
    assert host_room(meminfo, v1) == 19 * GIB - reserve
    assert host_room(tmp_path / "missing", no_cgroup) == 0
    assert host_room(write(tmp_path / "odd", "MemTotal: 1 kB\nMemAvailable:\n"), no_cgroup) == 0
