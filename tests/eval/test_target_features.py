"""draft.num_target_features: how many target layers a drafter reads, apart from its depth.

End to end on CPU: a 2-layer drafter reading 3 target layers trains, exports, reloads and decodes
losslessly; a drafter that silently read `num_layers` (2) layers instead fails the shape checks."""

import json

import pytest
import torch
from tiny import tiny_target

from dflash_train.config import ConfigError
from dflash_train.config_model import DraftConfig
from dflash_train.eval.export import export_drafter, load_drafter
from dflash_train.decode.spec_decode import speculative_generate
from dflash_train.draft.model import target_layer_ids
from dflash_train.checkpoint.local import latest_checkpoint
from dflash_train.train.loop import Trainer

from tests.decode.test_spec_decode import prompt, reference_greedy


def test_count_apart_from_depth():
    assert target_layer_ids(DraftConfig(num_layers=2, num_target_features=3), 8) == [1, 3, 5]
    assert target_layer_ids(DraftConfig(num_layers=4, num_target_features=5), 36) == [1, 9, 17, 25, 33]
    assert target_layer_ids(DraftConfig(num_layers=2), 8) == [1, 5]  # unset: the drafter's depth, as before
    assert target_layer_ids(DraftConfig(num_layers=2, target_layer_ids=[0, 2, 7]), 8) == [0, 2, 7]


def test_both_keys_is_an_error_naming_both(make_run_config):
    with pytest.raises(ConfigError, match="draft.target_layer_ids and draft.num_target_features both set"):
        make_run_config("both", ["draft.num_target_features=3"])  # make_run_config lists target_layer_ids


def test_more_layers_than_the_target_spaces_apart_is_an_error():
    # A 4-layer target's even spacing spans 1..1: three "distinct" layers would all be layer 1.
    with pytest.raises(ValueError, match=r"draft.num_target_features=3: a 4-layer target has no 3 distinct"):
        target_layer_ids(DraftConfig(num_layers=2, num_target_features=3), 4)


def test_two_layer_drafter_reading_three_target_layers_end_to_end(make_run_config, tmp_path):
    target = tiny_target(num_layers=8, initializer_range=0.1, eager=True)
    cfg = make_run_config("feat3", ["draft.target_layer_ids=null", "draft.num_layers=2",
                                    "draft.num_target_features=3", "train.max_steps=2"])
    trainer = Trainer(cfg, target=target)
    assert trainer.parts.drafter.config.target_layer_ids == [1, 3, 5]
    assert trainer.parts.drafter.config.num_hidden_layers == 2 and len(trainer.parts.drafter.layers) == 2
    assert trainer.parts.drafter.fc.weight.shape == (64, 3 * 64)  # the projection reads 3 layers' features
    summary = trainer.fit(progress=False)
    assert summary["steps"] == 2 and torch.isfinite(torch.tensor(summary["last"]["loss"]))

    out = export_drafter(latest_checkpoint(cfg.run_dir), tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    drafter = load_drafter(out, target)
    assert drafter.config.target_layer_ids == [1, 3, 5] and drafter.fc.weight.shape == (64, 192)
    for seed, (length, new) in enumerate([(5, 20), (12, 17)]):
        ids = prompt(length, target.vocab_size, seed)
        res = speculative_generate(target, drafter, ids, new)
        assert res.tokens == reference_greedy(target.model, ids, new)


def test_a_drafter_of_several_chooses_its_own_target_layers(make_run_config):
    from dflash_train.distributed.run import drafter_runs

    cfg = make_run_config("multi", ["drafters=[{name: a}, {name: b, draft: {num_target_features: 3}}]"])
    (_, a), (_, b) = drafter_runs(cfg)
    assert a.draft.target_layer_ids == [0, 2] and a.draft.num_target_features is None  # the base's
    assert b.draft.target_layer_ids is None and b.draft.num_target_features == 3  # not "both set"
    cfg = make_run_config("multi2", ["draft.target_layer_ids=null", "draft.num_target_features=3",
                                     "drafters=[{name: c, draft: {target_layer_ids: [1, 2]}}]"])
    ((_, c),) = drafter_runs(cfg)
    assert c.draft.target_layer_ids == [1, 2] and c.draft.num_target_features is None
