"""The features a compiled verification step reads (transformers' output_hidden_states) are what
Target.capture's hooks record."""

import torch

from .tiny_models import tiny_target


def test_selected_hidden_states_are_the_captured_features():
    target = tiny_target(num_layers=3)
    layer_ids = [2, 0]  # 2 is the last layer: final-normed either way
    ids = torch.randint(0, target.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), target.capture(layer_ids) as store:
        out = target.model(input_ids=ids, output_hidden_states=target.hidden_state_indices(layer_ids))
    for i, index in zip(layer_ids, target.hidden_state_indices(layer_ids)):
        assert torch.equal(out.hidden_states[index], store[i])
