"""draft.init_layers_from: drafter layers start as copies of chosen target decoder layers."""

from __future__ import annotations

import pytest
import torch

from dflash_train.config import build_config
from dflash_train.train.loop import Trainer


def test_each_drafter_layer_starts_as_its_target_layer(make_run_config, shared_tiny_target):
    cfg = make_run_config("copied", ["draft.num_layers=2", "draft.init_layers_from=[3,-3]"])
    drafter = Trainer(cfg, target=shared_tiny_target).parts.drafter
    fresh = Trainer(make_run_config("fresh", ["draft.num_layers=2"]), target=shared_tiny_target).parts.drafter
    for layer, copied_from in zip(drafter.layers, (3, 1)):
        source = dict(shared_tiny_target.layers[copied_from].named_parameters())
        assert source, "the tiny target's layers have parameters"
        for name, p in layer.named_parameters():
            # The tiny target is Qwen3: every drafter layer parameter has a twin, q/k norms included.
            torch.testing.assert_close(p.detach(), source[name].detach(), rtol=0, atol=0)
    # Only the layers: the context projection keeps its seeded fresh init.
    torch.testing.assert_close(drafter.fc.weight, fresh.fc.weight, rtol=0, atol=0)
    assert not torch.equal(drafter.layers[0].mlp.up_proj.weight, fresh.layers[0].mlp.up_proj.weight)


def test_a_layer_id_outside_the_target_is_refused(make_run_config, shared_tiny_target):
    cfg = make_run_config("bad", ["draft.init_layers_from=[4]"])  # the tiny target has layers 0..3
    with pytest.raises(ValueError, match="4 is not a layer of the target's 4"):
        Trainer(cfg, target=shared_tiny_target)


@pytest.mark.parametrize("draft, message", [
    ({"num_layers": 2, "init_layers_from": [1]}, "has 1 ids for draft.num_layers=2"),
    ({"num_layers": 1, "init_layers_from": [1], "intermediate_size": 32}, "the target's MLP width"),
])
def test_inconsistent_settings_are_refused(draft, message):
    with pytest.raises(ValueError, match=message):
        build_config({"draft": draft})
