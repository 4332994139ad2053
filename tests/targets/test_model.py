"""Frozen target: selective capture == HF hidden_states[i+1]; mask token resolution."""

from __future__ import annotations

import pytest
import torch

from dflash_train.targets.model import Target, resolve_mask_token_id
from tiny import tiny_target, tiny_tokenizer


@pytest.fixture(scope="module")
def target():
    return tiny_target(num_layers=4)


def batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 259, (2, 12), generator=gen)
    attn = torch.ones(2, 12, dtype=torch.long)
    attn[1, 8:] = 0  # right padding, as the trainer collates
    return ids, attn


@pytest.mark.parametrize("layer_ids", [[0], [1, 2], [2, 0]])
def test_features_equal_hf_hidden_states(target, layer_ids):
    ids, attn = batch()
    feats = target.features(ids, layer_ids)
    with torch.no_grad():
        hs = target.model(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states
    ref = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
    assert feats.shape == (2, 12, len(layer_ids) * target.hidden_size)
    valid = attn.bool()
    torch.testing.assert_close(feats[valid], ref[valid], rtol=1e-5, atol=1e-5)


def test_early_stop_does_not_change_features(target):
    ids, _ = batch()
    early = target.features(ids, [1])
    ran_last = []
    handle = target.layers[-1].register_forward_hook(lambda *a: ran_last.append(True))
    try:
        target.features(ids, [1])
        assert not ran_last, "layers after the deepest captured one must not run"
        with torch.no_grad(), target.capture([1], stop_after_last=False) as store:
            target.model(input_ids=ids)
    finally:
        handle.remove()
    assert ran_last
    torch.testing.assert_close(early, store[1], rtol=0, atol=0)


def test_bad_layer_id_is_refused_with_the_range(target):
    with pytest.raises(ValueError, match=r"0\.\.3"):
        target.features(batch()[0], [4])


def test_mask_token_explicit_id():
    tok = tiny_tokenizer()
    assert resolve_mask_token_id(7, tok, 272) == 7
    with pytest.raises(ValueError, match="objective.mask_token_id"):
        resolve_mask_token_id(272, tok, 272)


def test_mask_token_from_tokenizer():
    tok = tiny_tokenizer()
    tok.add_special_tokens({"mask_token": "<mask>"})
    assert tok.mask_token_id is not None
    assert resolve_mask_token_id(None, tok, 300) == tok.mask_token_id


def test_mask_token_first_unused_row():
    tok = tiny_tokenizer()
    assert len(tok) == 259
    assert resolve_mask_token_id(None, tok, 272) == 259


def test_mask_token_none_available_is_a_clear_error():
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="no usable mask token.*objective.mask_token_id"):
        resolve_mask_token_id(None, tok, len(tok))


def test_last_layer_id_matches_hf_hidden_states(target):
    ids, attn = batch()
    last = target.num_layers - 1
    feats = target.features(ids, [last])
    with torch.no_grad():
        hs = target.model(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states
    valid = attn.bool()
    torch.testing.assert_close(feats[valid], hs[last + 1][valid], rtol=1e-5, atol=1e-5)


def test_features_build_no_attention_mask(target, monkeypatch):
    """Training forwards run SDPA's causal kernels with no mask: transformers' mask preparation (and
    its host-side checks, a device sync each) must not run; the attention setting is restored."""
    import transformers.masking_utils as masking

    def forbidden(*args, **kwargs):
        raise AssertionError("mask preparation ran")

    monkeypatch.setattr(masking, "find_packed_sequence_indices", forbidden)
    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", forbidden)
    assert target.model.config._attn_implementation == "sdpa"
    ids, attn = batch()
    feats = target.features(ids, [1, 2])
    assert target.model.config._attn_implementation == "sdpa"
    monkeypatch.undo()
    with torch.no_grad():
        hs = target.model(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states
    valid = attn.bool()
    torch.testing.assert_close(feats[valid], torch.cat([hs[2], hs[3]], -1)[valid], rtol=1e-5, atol=1e-5)


def test_sliding_window_layers_keep_their_masks():
    """A model with sliding-window layers keeps transformers' own masks: windows are honoured."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_train.targets.model import Target

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_sliding_window=True,
                         sliding_window=3, max_window_layers=0, layer_types=["sliding_attention"] * 2)
    model = Qwen3ForCausalLM(config).eval()
    target = Target(model=model, tokenizer=tiny_tokenizer(), name="sliding", device=torch.device("cpu"))
    ids = batch()[0][:1]
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True).hidden_states[2]
    torch.testing.assert_close(target.features(ids, [1]), ref, rtol=1e-5, atol=1e-5)


def test_whole_forward_gives_the_models_own_logits_and_features(target):
    """hidden_and_features + logits = model(...).logits (what eval's batched decoder verifies with)."""
    ids = torch.randint(0, target.vocab_size - 1, (2, 9))
    hidden, features = target.hidden_and_features(ids, [0, 3])
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(target.logits(hidden), out.logits)
    torch.testing.assert_close(features, torch.cat([out.hidden_states[1], out.hidden_states[4]], dim=-1))


def test_logits_apply_the_models_soft_capping():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from dflash_train.targets.model import Target

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           final_logit_softcapping=0.5, initializer_range=0.5)).eval()
    target = Target(model=model, tokenizer=tiny_tokenizer(), name="gemma2", device=torch.device("cpu"))
    ids = torch.randint(0, 64, (1, 6))
    hidden, _ = target.hidden_and_features(ids, [0])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    assert model.lm_head(hidden).abs().max() > 2 and expected.abs().max() <= 0.5  # the cap bites
    torch.testing.assert_close(target.logits(hidden), expected)


def test_concurrent_first_loads_convert_the_embedded_model_once(tmp_path, monkeypatch):
    """Two processes (ranks of one launch, parallel test workers) loading SmolLM2 for the first time:
    one converts, the other waits for it and reads its result; neither swaps a second copy in."""
    import threading
    import time

    import dflash_train.targets.embedded as target_module

    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path))
    calls = []

    def slow_convert(packaged, model_name, out):
        calls.append(model_name)
        time.sleep(0.5)  # long enough for the second caller to arrive while the first converts
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(target_module, "convert", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(target_module.converted_target("smollm2")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]


def test_the_drafters_block_embeddings_are_the_ones_the_targets_forward_uses():
    """Gemma scales its embeddings by sqrt(hidden) inside the embedding module, and SGLang and vLLM
    feed the drafter the module's output: the table the drafter reads must be the scaled one (Llama's
    is the weight itself, no copy)."""
    from families import tiny_model

    ids = torch.arange(0, 272, 7)
    for family in ("gemma3", "llama3"):
        model = tiny_model(family)
        target = Target(model=model, tokenizer=tiny_tokenizer(), name=family, device=torch.device("cpu"))
        assert torch.equal(target.embed_weight[ids], model.get_input_embeddings()(ids))
    assert target.embed_weight is model.get_input_embeddings().weight
    gemma = tiny_model("gemma3").get_input_embeddings()
    assert not torch.equal(gemma(ids), gemma.weight[ids])  # the scale is real: the test can fail


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_per_row_fp8_target_needs_bfloat16_and_is_refused_before_it_loads(dtype, monkeypatch):
    import dflash_train.targets.model as target_model
    from dflash_train.config_model import TargetConfig

    monkeypatch.setattr(target_model, "fp8_problem", lambda device: None)  # as on an FP8 GPU
    cfg = TargetConfig(path="no-such/model", dtype=dtype, fp8="rowwise")
    with pytest.raises(ValueError, match=f"target.fp8=rowwise: .* loads in torch.{dtype}; set target.dtype=bfloat16"):
        target_model.load_target(cfg, torch.device("cpu"))
