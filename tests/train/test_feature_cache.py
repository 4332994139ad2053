"""The feature cache's two parts: rows past the device's room are kept in host memory and read back
bit for bit; past the host's room too they are made again. Checked against the rows themselves and
a brute-force padded batch."""

from __future__ import annotations

import pytest
import torch

from dflash_train.train import feature_cache
from dflash_train.train.feature_cache import FeatureCache, HostSlabs, host_room


class Rows:
    """`make` over fixed random rows of ragged lengths, counting what it is asked for."""

    def __init__(self, lengths: list[int], width: int, dtype: torch.dtype):
        g = torch.Generator().manual_seed(0)
        self.rows = [torch.randn(n, width, generator=g).to(dtype) for n in lengths]
        self.asked: list[int] = []

    def __call__(self, indices: list[int]) -> list[torch.Tensor]:
        self.asked += indices
        return [self.rows[i] for i in indices]


def reference(rows: list[torch.Tensor], indices: list[int], length: int) -> torch.Tensor:
    out = torch.zeros(len(indices) + 1, length, rows[0].shape[1], dtype=rows[0].dtype)  # + a padding row
    for r, i in enumerate(indices):
        out[r, : rows[i].shape[0]] = rows[i]
    return out


def batches(n: int, size: int) -> list[list[int]]:
    return [list(range(s, min(s + size, n))) for s in range(0, n, size)]


def epoch(cache: FeatureCache, rows: Rows, n: int, size: int = 3, length: int = 16) -> None:
    for indices in batches(n, size):
        batch = {"indices": indices, "input_ids": torch.zeros(len(indices) + 1, length, dtype=torch.long)}
        got = cache.features(batch, rows)
        assert torch.equal(got, reference(rows.rows, indices, length))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rows_past_the_device_are_kept_in_host_slabs_and_read_back_exactly(monkeypatch, dtype):
    monkeypatch.setattr(feature_cache, "SLAB_BYTES", 300)  # several rows a slab, several slabs
    lengths = [5, 16, 1, 9, 13, 7, 2, 11, 16, 3]
    rows = Rows(lengths, width=6, dtype=dtype)
    cache = FeatureCache(None, torch.device("cpu"), host=HostSlabs(pin=False, room=lambda: 10**9))
    room = iter([True])  # the first batch fits on the device, then it is full
    cache.has_room = lambda nbytes: next(room, False)
    for _ in range(3):
        epoch(cache, rows, len(lengths))
    assert sorted(rows.asked) == list(range(len(lengths)))  # every row made once, over three epochs
    assert cache.on_host == len(lengths) - 3 and len(cache) == len(lengths)
    assert len(cache.host.slabs) > 1
    for i in range(3, len(lengths)):  # host rows: views into the slabs, 64-byte aligned
        kept = cache.rows[i]
        assert any(kept.untyped_storage().data_ptr() == s.untyped_storage().data_ptr() for s in cache.host.slabs)
        assert kept.data_ptr() % 64 == 0


def test_past_the_hosts_room_the_rest_is_made_again_every_epoch(monkeypatch):
    monkeypatch.setattr(feature_cache, "SLAB_BYTES", 600)
    lengths = [8] * 12  # 8 x 6 fp32 = 192 bytes: three rows a slab
    rows = Rows(lengths, width=6, dtype=torch.float32)
    slabs_left = iter([600, 600])  # two slabs, then the host keeps only its reserve
    host = HostSlabs(pin=False, room=lambda: next(slabs_left, 0))
    cache = FeatureCache(None, torch.device("cpu"), host=host)
    cache.has_room = lambda nbytes: False  # nothing on the device
    epoch(cache, rows, len(lengths))
    assert cache.on_host == 6 and host.full and len(host.slabs) == 2
    rows.asked.clear()
    epoch(cache, rows, len(lengths))
    assert rows.asked == list(range(6, 12))  # only the rows cached nowhere


def test_host_room_leaves_the_reserve():
    with open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
    reserve = feature_cache.HOST_RESERVE_GIB * 2**30 + info["MemTotal"] // 10
    assert abs(host_room() - (info["MemAvailable"] - reserve)) < 2**28  # MemAvailable moves a little between reads
