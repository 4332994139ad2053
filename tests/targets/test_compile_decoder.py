"""`target.compile` (targets/model.compile_decoder): each decoder layer's forward compiled (inductor's
C++ backend on CPU) gives the eager features and whole forward, capture hooks and early stop included,
over five lengths, four row counts and three layer selections through three graphs (the first
shape's, then one symbolic in rows and length, and a single row's); the hooks added per call
recompile nothing; `Target.eager()` runs
the layers uncompiled and gives them back. Where it is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from dflash_train.config import ConfigError
from dflash_train.config_model import TargetConfig
from dflash_train.eval.config import build_eval_config
from dflash_train.targets.model import Target, compile_decoder, load_target
from tiny import tiny_target


@pytest.mark.slow(seconds=40)  # three C++ graphs of a decoder layer
def test_compiled_layers_give_the_eager_features_through_three_graphs():
    torch._dynamo.reset()  # what dynamo remembers of the layer's forward from other tests goes
    counters.clear()
    target = tiny_target(num_layers=4, hidden=64)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, target.vocab_size, (rows, n), generator=g)
               for rows, n in ((2, 32), (3, 48), (2, 64), (1, 40), (4, 32), (1, 56))]
    selections = ([0, 2], [1], [3, 1])  # hooked layers and not; stopping early, and the final-normed last
    eager = [[target.features(ids, ids_of) for ids_of in selections] for ids in batches]
    whole = target.hidden_and_features(batches[1], [1, 3])
    compile_decoder(target)
    compile_decoder(target)  # once
    assert target.compiled and target.description["compiled"]
    for ids, expected in zip(batches, eager):
        for ids_of, features in zip(selections, expected):
            torch.testing.assert_close(target.features(ids, ids_of), features, atol=1e-5, rtol=1e-5)
    for got, expected in zip(target.hidden_and_features(batches[1], [1, 3]), whole):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]

    compiled = [layer.forward for layer in target.layers]
    with target.eager():  # evaluation: a KV-cached decode through the layers' own forwards
        assert all("forward" not in vars(layer) for layer in target.layers)
        target.model.generate(batches[0][:1], max_new_tokens=3, do_sample=False)
    assert [layer.forward for layer in target.layers] == compiled
    assert counters["stats"]["unique_graphs"] == 3


def test_a_target_without_its_layers_has_nothing_to_compile():
    """A drafter-only rank's target (its layers replaced, load_target(decoder=False)): nothing compiled
    here, nothing to warm up, but the manifest its rank writes says the target ranks compile theirs."""
    target = tiny_target(num_layers=2, hidden=64)
    for i in range(len(target.layers)):
        target.layers[i] = nn.Identity()
    target = Target(model=target.model, tokenizer=target.tokenizer, name="no-layers", device=target.device)
    assert not target.decoder
    compile_decoder(target)
    assert "forward" not in vars(target.layers[0])  # compiling sets an instance forward
    assert not target.compiled_here and target.description["compiled"] is True


def test_compiled_targets_are_refused_where_untested():
    with pytest.raises(ValueError, match="target.compile with target.tensor_parallel > 1"):
        load_target(TargetConfig(path="unused", compile=True, tensor_parallel=2), torch.device("cpu"), mesh=object())
    with pytest.raises(ConfigError, match="target.compile compiles training's target forward; eval decodes"):
        build_eval_config(None, {"target.path": "smollm2", "drafter": "d", "target.compile": True})
