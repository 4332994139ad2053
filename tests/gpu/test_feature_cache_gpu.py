"""On CUDA: rows past the device's room go to page-locked host slabs and come back without a host
sync (torch's sync debug mode in "error" raises at the first synchronising call), bit for bit.
Run: `python -m pytest tests/gpu -m gpu`."""

from __future__ import annotations

import pytest
import torch

from dflash_train.train import feature_cache
from dflash_train.train.feature_cache import FeatureCache, HostSlabs

from train.helpers_cache import Rows, epoch_batches, reference  # tests/ is on sys.path (conftest.py)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_host_rows_are_pinned_and_read_back_without_a_host_sync(monkeypatch):
    monkeypatch.setattr(feature_cache, "SLAB_BYTES", 2**20)
    lengths = [300, 1024, 17, 512, 999, 64, 1024, 5] * 4
    rows = Rows(lengths, width=2880, dtype=torch.bfloat16, device="cuda")
    cache = FeatureCache(torch.device("cuda"), host=HostSlabs(pin=True, room=lambda: 2**31))
    cache.has_room = lambda nbytes: False  # every row goes to the host
    out = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):  # epoch 1 copies to the host, epoch 2 reads back
            for batch in epoch_batches(len(lengths), 4, 1024):
                out.append((batch["indices"], cache.features(batch, rows)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cache.on_host == len(lengths) and all(s.is_pinned() for s in cache.host.slabs)
    for indices, got in out:
        assert torch.equal(got.cpu(), reference(rows.rows, indices, 1024))
