"""The drafter's sliding window in every decoder: each round's drafter output equals the training
forward's (draft/masks.py `dense_mask`, held to a brute-force loop in tests/draft/test_masks.py)
over the committed sequence with the anchor at the round's start, so decoding sees exactly the keys
training sees; and the window changes what the drafter computes."""

import pytest
import torch

from dflash_train.decode.batched import batched_speculative
from dflash_train.decode.spec_decode import speculative_generate
from dflash_train.decode.static_decode import StaticDecoder
from dflash_train.draft import masks
from dflash_train.draft.model import DFlashDraftModel

from tests.eval.tiny_models import tiny_drafter, tiny_target

BLOCK, WINDOW, PROMPT, NEW = 4, 6, 19, 24


class RecordingDrafter(DFlashDraftModel):
    """Records each forward's block positions, block embeddings and output."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls = []

    def forward(self, context, block_embeds, context_positions, block_positions, mask=None, cache=None):
        out = super().forward(context, block_embeds, context_positions, block_positions, mask=mask, cache=cache)
        self.calls.append((block_positions.clone(), block_embeds.clone(), out.clone()))  # a static decoder reuses them
        return out


def recording(target, window):
    base = tiny_drafter(target, block_size=BLOCK, sliding_window=window)
    drafter = RecordingDrafter(base.config).eval().requires_grad_(False)
    drafter.load_state_dict(base.state_dict())
    return drafter


def decode(kind, target, drafter, prompt):
    if kind == "spec":
        return speculative_generate(target, drafter, torch.tensor([prompt]), NEW).tokens
    if kind in ("batched", "batched-uncached"):
        return batched_speculative(target, drafter, [prompt], NEW, cached=kind == "batched")[0].tokens
    decoder = StaticDecoder(target, drafter, rows=1, max_len=len(prompt) + NEW, block_size=BLOCK)
    return decoder.speculative([prompt], NEW).results[0].tokens


def training_view(drafter, features, block_positions, block_embeds, window):
    """The training forward of one block at its start over the whole committed context."""
    t = features.shape[1]
    anchors = block_positions[:, :1]
    mask = masks.dense_mask(anchors, BLOCK, t, window)
    return drafter(features, block_embeds, torch.arange(t)[None], block_positions, mask)


@pytest.mark.parametrize("kind", ["spec", "batched", "batched-uncached", "static"])
def test_every_round_sees_the_keys_training_sees(kind):
    target = tiny_target()
    drafter = recording(target, WINDOW)
    prompt = torch.randint(0, 255, (PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()
    tokens = decode(kind, target, drafter, prompt)
    calls = list(drafter.calls)
    _, features = target.hidden_and_features(torch.tensor([prompt + tokens]), drafter.config.target_layer_ids)
    assert len(calls) >= 3
    differs = False
    for positions, embeds, out in calls:
        positions, embeds, out = positions[:1], embeds[:1], out[:1]
        start = int(positions[0, 0])
        assert start + BLOCK - 1 > WINDOW  # the window cuts the context of every round's last slot
        want = training_view(drafter, features, positions, embeds, WINDOW)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
        full = training_view(drafter, features, positions, embeds, None)
        differs |= not torch.allclose(out, full, atol=1e-3)
    assert differs, "the window changed nothing: the test would not see it missing"
