"""bench/peer_modelopt.py: Model-Optimizer's drafter, converted to ours, computes its logits.

Needs nvidia-modelopt 0.47.0 (not a dependency: docs/benchmarks/peers.md says how to put it on
PYTHONPATH); skipped without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

mtsp = pytest.importorskip("modelopt.torch.speculative")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from peer_modelopt import peer_config, rotary_compat, save_ours, to_ours  # noqa: E402

from dflash_train.config import build_config  # noqa: E402
from dflash_train.draft.masks import dense_mask  # noqa: E402
from dflash_train.draft.model import DraftModelConfig  # noqa: E402
from dflash_train.eval.export import load_drafter  # noqa: E402
from dflash_train.targets.model import Target  # noqa: E402

VOCAB, BLOCK = 96, 4


def tiny_hf_target(rope_theta: float) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, initializer_range=0.1,
    )
    return Qwen3ForCausalLM(config).eval().requires_grad_(False)


def converted(model, dflash: dict):
    torch.manual_seed(1)
    model = mtsp.convert(model, [("dflash", dflash)])
    rotary_compat(model)
    return model.eval()


def peer_logits_and_inputs(model, seq_len: int = 24):
    """Its own training-forward pieces on one batch: anchors, block embeddings, positions, mask,
    captured target layers, drafter, target LM head."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB - 1, (2, seq_len), generator=gen)
    loss_mask = torch.ones(2, seq_len)
    loss_mask[:, :5] = 0
    anchors, keep = model._sample_anchor_positions(seq_len, loss_mask, ids.device)
    assert keep.all()  # every block valid: a fully masked row has no softmax to compare
    n = anchors.shape[1]
    noise = model._build_noise_embedding(ids, anchors, keep, n)
    positions = model._build_position_ids(seq_len, anchors, ids.device)
    mask = model._build_draft_attention_mask(seq_len, anchors, keep, n, torch.float32, ids.device)
    hidden = model._base_model(input_ids=ids, output_hidden_states=True).hidden_states
    context = torch.cat([hidden[i + 1] for i in model.target_layer_ids], dim=-1)
    with torch.no_grad():
        logits = model._base_model_lm_head(model.dflash_module(noise, context, positions, mask))
    return logits, (context, noise, positions, mask == 0, anchors)


def our_logits(drafter, model, inputs):
    context, noise, positions, mask, _ = inputs
    t = context.shape[1]
    with torch.no_grad():
        return model._base_model_lm_head(drafter(context, noise, positions[:, :t], positions[:, t:], mask))


def test_converted_drafter_gives_model_optimizers_logits_and_its_export_does_not(tmp_path):
    """Its defaults on transformers 5 (no sizes, no RoPE given): the drafter trains at Qwen3Config's
    RoPE base 1e4 while its exporter writes the target's 1e5. `to_ours` keeps what the drafter ran
    with, so our model reproduces its logits; its own export, read as written, does not."""
    arch = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 128}
    model = converted(tiny_hf_target(rope_theta=1e5), {
        "dflash_block_size": BLOCK, "dflash_num_anchors": 3, "dflash_mask_token_id": VOCAB - 1,
        "dflash_architecture_config": arch})
    theirs, inputs = peer_logits_and_inputs(model)
    # its mask is our rule: context strictly below the anchor, own block both ways
    assert torch.equal(inputs[3], dense_mask(inputs[4], BLOCK, inputs[0].shape[1]))

    cfg, state = to_ours(model)
    assert cfg.rope_theta == 1e4 and cfg.block_size == BLOCK and cfg.target_layer_ids == model.target_layer_ids
    target = Target(model=model, tokenizer=None, name="tiny", device=torch.device("cpu"))
    ours = our_logits(load_drafter(save_ours(cfg, state, tmp_path / "ours"), target), model, inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    model.get_exporter().export(tmp_path / "theirs")
    as_exported = our_logits(load_drafter(tmp_path / "theirs", target), model, inputs)
    assert (as_exported - theirs).abs().max() > 1e-2  # the RoPE base it trained with is not the one written


def test_peer_config_builds_our_drafter_shape():
    """Every size, the captured layers, the mask token and the RoPE base passed through: the converted
    drafter's config is ours field for field."""
    model = tiny_hf_target(rope_theta=1e5)
    ours = DraftModelConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=80,
        num_hidden_layers=3, vocab_size=VOCAB, block_size=BLOCK, target_layer_ids=[0, 2, 5], num_target_layers=6,
        mask_token_id=7, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=256,
    )
    run = build_config({"objective": {"num_anchors": 3, "gamma": 4.0}})
    model = converted(model, peer_config(run, ours, loss="kd", weights="dpace"))
    assert to_ours(model)[0] == ours
    assert model.dflash_num_anchors == 3 and model.dflash_self_logit_distillation
    assert model.dflash_loss_objective == "dpace"
    proportional = build_config({"objective": {"num_anchors": 3, "num_anchors_length": 64}})
    with pytest.raises(ValueError, match="fixed number of anchors a row"):
        peer_config(proportional, ours, loss="kd", weights="dpace")
