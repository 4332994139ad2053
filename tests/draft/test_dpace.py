"""D-PACE slot weights (objective.slot_weights=dpace) against float64 references: the weights by their
definition and as the derivative of the expected accepted length; the chunked loss and its gradient,
blocks spanning chunks; one trainer step against the loss formed by hand; the config's rules."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_train.config import ConfigError, build_config
from dflash_train.draft.loss import LossMix, block_loss, dpace_weights
from dflash_train.draft.objective import draft_hidden, make_task
from dflash_train.train.loop import Trainer

B = 5


def brute_force_weights(q: torch.Tensor, counted: torch.Tensor, alpha: float) -> torch.Tensor:
    """weight_k = sum over counted j >= k of prod over counted i <= j of ((1 - alpha) q_i + alpha)."""
    out = torch.zeros_like(q, dtype=torch.float64)
    for r in range(q.shape[0]):
        for k in range(q.shape[1]):
            if not counted[r, k]:
                continue
            for j in range(k, q.shape[1]):
                if counted[r, j]:
                    out[r, k] += math.prod((1 - alpha) * float(q[r, i]) + alpha
                                           for i in range(j + 1) if counted[r, i])
    return out


def random_blocks(seed: int, blocks: int = 6):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(blocks, B, generator=g, dtype=torch.float64)
    counted = (torch.rand(blocks, B, generator=g) > 0.25).double()
    counted[:, 0] = 0  # slot 0 is the anchor's own token
    counted[0, 3:] = 0  # a block cut by the end of its answer
    return q, counted


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_weights_by_their_definition(alpha):
    q, counted = random_blocks(0)
    torch.testing.assert_close(dpace_weights(q, counted, alpha), brute_force_weights(q, counted, alpha))


def test_weights_are_the_derivative_of_the_expected_accepted_length():
    """E = sum_j counted_j prod_{i<=j} s_i over counted i: dE / d log s_k is slot k's weight."""
    q, counted = random_blocks(1)
    alpha = 0.3
    s = ((1 - alpha) * q + alpha).requires_grad_()
    log_s = torch.where(counted > 0, s.log(), torch.zeros_like(s))
    expected = (torch.cumsum(log_s, -1).exp() * counted).sum()
    (grad,) = torch.autograd.grad(expected, s)
    torch.testing.assert_close(grad * s * counted, dpace_weights(q, counted, alpha))


def problem(seed=0, b=2, n=4, h=16, v=29):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, n * B, h, generator=g)
    head = torch.randn(v, h, generator=g) * 0.7
    labels = torch.randint(0, v, (b, n * B), generator=g)
    mask = (torch.rand(b, n * B, generator=g) > 0.2).float()
    mask.view(b, n, B)[:, :, 0] = 0
    return hidden, head, labels, mask


def reference(hidden, head, labels, mask, alpha, block_size=B):
    """The D-PACE loss in float64: sum of weight_k x CE_k, the weights from the detached probabilities."""
    logits = hidden.reshape(-1, hidden.shape[-1]).double() @ head.double().t()
    log_q = torch.log_softmax(logits, -1).gather(1, labels.reshape(-1, 1)).squeeze(1)
    counted = mask.reshape(-1, block_size).double()
    weights = brute_force_weights(log_q.detach().exp().view(-1, block_size), counted, alpha).view(-1)
    return -(weights * log_q).sum()


@pytest.mark.parametrize("chunk_size", [3, 7, 4096])
def test_chunked_loss_and_gradient_equal_the_float64_reference(chunk_size):
    """Chunks of 3 and 7 rows cut through blocks of 5: a block's weights need rows of two chunks."""
    hidden, head, labels, mask = problem()
    h64 = hidden.double().requires_grad_()
    ref = reference(h64, head, labels, mask, 0.5)
    ref.backward()
    h = hidden.clone().requires_grad_()
    out = block_loss(h, head, labels, mask, B, chunk_size, LossMix(dpace_alpha=0.5))
    out.weighted_ce_sum.backward()
    torch.testing.assert_close(out.weighted_ce_sum.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)


def test_dpace_off_is_the_plain_weighted_loss():
    """alpha 1: every counted slot's weight is the number of counted slots from it on, a fixed weight."""
    hidden, head, labels, mask = problem(seed=2)
    fixed = brute_force_weights(torch.zeros(mask.numel() // B, B), mask.reshape(-1, B), 1.0).view_as(mask).float()
    plain = block_loss(hidden, head, labels, fixed, B, 7)
    dpace = block_loss(hidden, head, labels, mask, B, 7, LossMix(dpace_alpha=1.0))
    torch.testing.assert_close(dpace.weighted_ce_sum, plain.weighted_ce_sum, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dpace.correct_per_slot, plain.correct_per_slot)


def test_a_trainer_step_is_the_dpace_loss_formed_by_hand(make_run_config, shared_tiny_target):
    """objective.slot_weights=dpace through the trainer: the logged loss is sum(w x CE) / counted slots,
    w from the drafter's own probabilities of the data tokens."""
    cfg = make_run_config(overrides=["objective.slot_weights=dpace", "objective.gamma=7.0",
                                     "objective.dpace_alpha=0.25", "train.grad_clip=1e9"])
    trainer = Trainer(cfg, target=shared_tiny_target)
    logged = float(trainer.train_step()["loss"])

    ref = Trainer(cfg, target=shared_tiny_target)
    d = ref.parts.drafter.config
    batch, seed = ref.stepper.local.next_micro_batch(ref.progress)
    task = make_task(batch["input_ids"], batch["loss_mask"], cfg.objective, seed)
    assert set(task.weights.unique().tolist()) <= {0.0, 1.0}  # the mask alone: D-PACE weighs in the loss
    feats = ref.parts.target.features(batch["input_ids"], d.target_layer_ids)
    with torch.no_grad():
        hidden = draft_hidden(ref.parts.drafter, task, feats, ref.parts.target.embed_weight, False)
        total = reference(hidden, ref.parts.target.lm_head_weight, task.labels, task.weights, 0.25, d.block_size)
    assert logged == pytest.approx(float(total / task.weights.sum()), rel=1e-4)


def test_config_rules(make_run_config):
    dpace = make_run_config(overrides=["objective.slot_weights=dpace", "objective.gamma=7.0"])
    assert dpace.objective.dpace_alpha == 0.5
    with pytest.raises(ConfigError, match="objective.gamma is not read with objective.slot_weights=dpace"):
        make_run_config(overrides=["objective.slot_weights=dpace"])  # the fixture sets gamma 4
    with pytest.raises(ConfigError, match="objective.dpace_alpha is not read with objective.slot_weights=decay"):
        make_run_config(overrides=["objective.dpace_alpha=0.3"])
    with pytest.raises(ConfigError, match="dpace_alpha"):
        make_run_config(overrides=["objective.slot_weights=dpace", "objective.gamma=7.0", "objective.dpace_alpha=2"])
    # a saved run config lists every key, the unread gamma at its default
    assert build_config(dpace.model_dump(mode="json")).objective.slot_weights == "dpace"


def test_slot_weights_left_unset_are_dpace_unless_the_run_asks_for_the_decay_or_cannot_weigh_by_dpace(make_run_config):
    """D-PACE is the default; a run config without objective.slot_weights gets the decay where it sets
    another gamma, trains a family with a logit bias (DSpark), or runs a fused CE kernel."""
    default_gamma = "objective.gamma=7.0"  # the fixture sets gamma 4
    assert make_run_config(overrides=[default_gamma]).objective.slot_weights == "dpace"
    assert make_run_config().objective.slot_weights == "decay"  # gamma 4
    assert make_run_config(overrides=[default_gamma, "draft.family=dspark"]).objective.slot_weights == "decay"
    fused = build_config({"objective": {"loss": {"ce": 1}}, "train": {"ce_kernel": "liger"}, "device": "cuda"})
    assert fused.objective.slot_weights == "decay"
    defaults = build_config({})
    assert (defaults.objective.slot_weights, defaults.objective.selector_outside_top_k) == ("dpace", "skip")
    with pytest.raises(ConfigError, match="objective.slot_weights=decay"):  # chosen, not left unset: refused
        make_run_config(overrides=[default_gamma, "draft.family=dspark", "objective.slot_weights=dpace"])


def test_a_drafter_of_a_stream_weighs_as_a_run_alone_would_and_keeps_a_chosen_decay(make_run_config):
    from dflash_train.distributed.layout import drafter_runs

    entries = [{"name": "b4"}, {"name": "g4", "objective": {"gamma": 4.0}}, {"name": "spark", "draft": {"family": "dspark"}}]
    cfg = make_run_config(overrides=["objective.gamma=7.0", ("drafters", entries)])
    assert {name: run.objective.slot_weights for name, run in drafter_runs(cfg)} == \
        {"b4": "dpace", "g4": "decay", "spark": "decay"}
    chosen = make_run_config(overrides=["objective.gamma=7.0", "objective.slot_weights=decay",
                                        ("drafters", [{"name": "two", "draft": {"family": "dflash2"},
                                                       "objective": {"loss": {"ce": 1, "selector": 1}}}])])
    assert drafter_runs(chosen)[0][1].objective.slot_weights == "decay"  # the base's choice, not the default


def test_a_resume_refuses_weights_other_than_the_checkpoints(make_run_config, tmp_path):
    """A run saved when the decay and join were the defaults, resumed with a config that now resolves
    to D-PACE and skip: refused in one line naming the key, unless the config names what it trained with."""
    from types import SimpleNamespace

    from dflash_train.config import dump_config
    from dflash_train.train.checkpointer import Checkpointer

    selector = ["objective.gamma=7.0", "draft.family=dflash2", "objective.loss={ce: 1, selector: 1}"]
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(make_run_config(overrides=[*selector, "objective.slot_weights=decay",
                                                            "objective.selector_outside_top_k=join"])))
    with pytest.raises(ValueError, match="objective.slot_weights=decay, the config now gives dpace"):
        Checkpointer.check_weighting_kept(SimpleNamespace(cfg=make_run_config(overrides=selector)), saved)
    with pytest.raises(ValueError, match="objective.selector_outside_top_k=join, the config now gives skip"):
        Checkpointer.check_weighting_kept(
            SimpleNamespace(cfg=make_run_config(overrides=[*selector, "objective.slot_weights=decay"])), saved)
    as_trained = make_run_config(overrides=[*selector, "objective.slot_weights=decay", "objective.selector_outside_top_k=join"])
    Checkpointer.check_weighting_kept(SimpleNamespace(cfg=as_trained), saved)


def test_configs_saved_before_the_defaults_changed_still_load(make_run_config):
    """A DFlash run saved with join, the old default, lists it though it trains no selector."""
    from dflash_train.config import dump_config
    import yaml

    tree = yaml.safe_load(dump_config(make_run_config()))
    tree["objective"]["selector_outside_top_k"] = "join"
    assert build_config(tree).objective.selector_outside_top_k == "join"
    with pytest.raises(ConfigError, match="selector_weights is read with objective.loss.selector only"):
        build_config({**tree, "objective": {**tree["objective"], "selector_weights": "uniform"}})


def test_the_fused_kernel_refuses_dpace():
    hidden, head, labels, mask = problem()
    with pytest.raises(ValueError, match="decay-weighted"):
        block_loss(hidden, head, labels, mask, B, 7, LossMix(dpace_alpha=0.5), kernel="liger")
