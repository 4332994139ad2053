"""On CUDA (compute capability >= 8.9, torchao installed): FP8 training of the drafter (`draft.fp8`)
and the loss's FP8 head (`train.fp8_lm_head`) against the bf16 step on the same batch, an FP8 target's features against its bf16 features, and
resume from an FP8 run's checkpoint against the uninterrupted run.

On a GPU host: `python -m pytest tests/gpu -m gpu`.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml

from dflash_train.config import build_config
from dflash_train.checks.fp8 import fp8_problem
from dflash_train.draft.fp8 import RECIPES, convert_to_fp8
from dflash_train.draft.fp8_head import Fp8Head
from dflash_train.draft.loss import LossMix
from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig
from dflash_train.draft.objective import draft_loss, make_task

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or fp8_problem(torch.device("cuda")) is not None,
                       reason="needs a CUDA GPU that runs FP8 matmuls, and torchao"),
]

H, V, LAYERS, T = 1024, 8192, [1, 4, 7], 2043  # T not a multiple of 16, as ragged batches
LOSS_RTOL = 0.01
"""The FP8 step's loss within 1% of the bf16 step's (measured: see the test's printout)."""
GRAD_COSINE = {"tensorwise": 0.96, "rowwise": 0.965, "rowwise_with_gw_hp": 0.965}
"""Each parameter's gradient: cosine similarity with the bf16 step's at least this."""
HEAD_GRAD_COSINE = 0.995
"""The same bound for the FP8 head (train.fp8_lm_head) with bf16 layers (measured on an H200: 0.9995)."""


def _step(drafter, task, stream, embed, head, compiled_loss=False):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = draft_loss(drafter, task, stream, embed, head, True, 4096, LossMix(), compiled_loss=compiled_loss)
    loss = out.weighted_ce_sum / task.weights.sum()
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in drafter.named_parameters()}


def _drafter_and_batch():
    """A 2-layer drafter at hidden 1,024 and one batch: 2 x 2,043 context tokens, 128 anchors."""
    torch.manual_seed(0)
    config = DraftModelConfig(hidden_size=H, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                              intermediate_size=3072, num_hidden_layers=2, vocab_size=V, block_size=16,
                              target_layer_ids=LAYERS, num_target_layers=10, mask_token_id=V - 1)
    drafter = DFlashDraftModel(config).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, V - 1, (2, T), device="cuda", generator=gen)
    stream = torch.randn(2, T, len(LAYERS) * H, device="cuda", dtype=torch.bfloat16, generator=gen)
    embed = torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    head = torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
    objective = build_config({"objective": {"block_size": 16, "num_anchors": 128, "mask_token_id": V - 1}}).objective
    task = make_task(ids, torch.ones_like(ids, dtype=torch.bool), objective, 0)
    return drafter, task, stream, embed, head


def _compare(label, loss_ref, grads_ref, loss, grads, min_cosine):
    cosines = {n: torch.nn.functional.cosine_similarity(grads[n].flatten(), grads_ref[n].flatten(), dim=0).item()
               for n in grads_ref}
    print(json.dumps({"setting": label, "loss_bf16": loss_ref, "loss_fp8": loss,
                      "min_grad_cosine": min(cosines.values())}))
    assert abs(loss - loss_ref) <= LOSS_RTOL * abs(loss_ref)
    assert min(cosines.values()) >= min_cosine, sorted(cosines.items(), key=lambda kv: kv[1])[:3]


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_step_matches_the_bf16_step(recipe):
    bf16, task, stream, embed, head = _drafter_and_batch()
    fp8 = copy.deepcopy(bf16)
    assert convert_to_fp8(fp8, recipe) == 1 + 2 * 7  # fc, and each layer's 4 projections and 3 MLP matmuls
    assert list(fp8.state_dict()) == list(bf16.state_dict())  # checkpoints and exports do not change
    loss_ref, grads_ref = _step(bf16, task, stream, embed, head)
    loss, grads = _step(fp8, task, stream, embed, head)
    _compare(recipe, loss_ref, grads_ref, loss, grads, GRAD_COSINE[recipe])


@pytest.mark.parametrize("compiled_loss", [False, True])
def test_fp8_head_step_matches_the_bf16_step(compiled_loss):
    """train.fp8_lm_head: the loss's head matmuls on the FP8 tensor cores, eager and compiled."""
    drafter, task, stream, embed, head = _drafter_and_batch()
    twin = copy.deepcopy(drafter)
    loss_ref, grads_ref = _step(drafter, task, stream, embed, head, compiled_loss)
    loss, grads = _step(twin, task, stream, embed, Fp8Head(head), compiled_loss)
    _compare(f"fp8 head, compiled loss {compiled_loss}", loss_ref, grads_ref, loss, grads, HEAD_GRAD_COSINE)


def test_fp8_target_features_stay_close_to_bf16():
    """The FP8 target's decoder (target.fp8) gives features close to its bf16 forward's, and its
    quantisation leaves torch.compile's settings as they were."""
    from families import tiny_model

    from dflash_train.targets.fp8 import quantize_decoder

    model = tiny_model("qwen3").to("cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (4, 256), device="cuda")
    reference = model(ids, output_hidden_states=True).hidden_states
    tuning = torch._inductor.config.coordinate_descent_tuning
    assert quantize_decoder(model.model.layers, "rowwise") > 0
    assert torch._inductor.config.coordinate_descent_tuning == tuning  # torchao's default turns it on
    quantised = model(ids, output_hidden_states=True).hidden_states
    for ref, got in zip(reference[1:], quantised[1:]):
        cosine = torch.nn.functional.cosine_similarity(ref.float().flatten(), got.float().flatten(), dim=0).item()
        assert cosine > 0.98, cosine


def test_resume_from_an_fp8_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """Train 6 FP8 steps (layers and head) straight; resume a copy from its step-3 checkpoint: the
    same losses."""
    import shutil

    from test_families import _save_target

    from dflash_train.cli import main
    from dflash_train.train.metrics import read_metrics

    model_dir = _save_target("qwen3", tmp_path / "target")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}: say phrase {i % 3}"},
                                                     {"role": "assistant", "content": f"the phrase is {i % 3} " * 6}]})
                            + "\n" for i in range(48)))

    def config(name: str):
        tree = {"run_dir": str(tmp_path / name), "seed": 0, "device": "cuda", "target": {"path": str(model_dir)},
                "draft": {"num_layers": 1, "target_layer_ids": [0, 2], "fp8": "rowwise", "attention": "sdpa"},
                "objective": {"block_size": 4, "num_anchors": 8},
                "data": {"train_files": [str(data)], "max_length": 96, "token_budget": 384, "max_batch_size": 6},
                "train": {"lr": 3e-3, "log_every": 1, "max_steps": 6, "fp8_lm_head": True}, "checkpoint": {"every": 3, "keep_last": 2}}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(tree))
        return path

    assert main(["train", "-c", str(config("straight"))]) == 0
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    assert main(["train", "-c", str(config("resumed")), "--resume", str(tmp_path / "resumed/checkpoints/step_00000003")]) == 0
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
