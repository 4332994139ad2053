"""On CUDA: preparing a micro-batch's block task makes no host sync (torch's sync debug mode in
"error" raises at the first synchronising call). Run: `python -m pytest tests/gpu -m gpu`."""

from __future__ import annotations

import pytest
import torch

from dflash_train.draft import masks

from draft.test_masks import sample_anchors  # tests/ is on sys.path (conftest.py)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_anchor_sampling_and_labels_make_no_host_sync():
    loss_mask = torch.zeros(2, 3072, dtype=torch.long)
    loss_mask[0, 500:] = 1
    loss_mask[1, 100:900] = 1
    ids = torch.randint(0, 1000, (2, 3072))
    loss_mask, ids = loss_mask.cuda(), ids.cuda()
    cpu_anchors, _ = sample_anchors(loss_mask.cpu(), 512, torch.Generator().manual_seed(3))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        anchors, valid = sample_anchors(loss_mask, 512, torch.Generator().manual_seed(3))
        masks.block_labels(ids, loss_mask, anchors, valid, 16, 7.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(anchors.cpu(), cpu_anchors)  # the same anchors as on CPU
