"""The draft side of one training micro-batch: anchors -> blocks -> mask -> forward -> loss.

Shared by the single-process trainer and the drafter ranks of distributed training, so both
compute exactly the same function of (tokens, features, anchor seed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_train.config_model import ObjectiveConfig
from dflash_train.draft import masks
from dflash_train.draft.dflash2 import selector_inputs
from dflash_train.draft.acceptance import BlockLoss
from dflash_train.draft.loss import LossMix, block_loss
from dflash_train.draft.model import DFlashDraftModel


@dataclass
class BlockTask:
    """Everything about a micro-batch that is known before the drafter runs."""

    input_ids: torch.Tensor  # [b, T]
    anchors: torch.Tensor  # [b, N]
    valid: torch.Tensor  # [b, N]
    labels: torch.Tensor  # [b, N*B]
    weights: torch.Tensor  # [b, N*B] loss weights (0 = not counted)
    seed: int | None = None
    """The micro-batch's seed (`make_task`), for its draws beyond the anchors (objective.feature_noise);
    None where the anchor keys came ready (the captured step)."""


def make_task(input_ids: torch.Tensor, loss_mask: torch.Tensor, objective: ObjectiveConfig, anchor_seed: int) -> BlockTask:
    """Anchors come from a generator seeded per micro-batch: resume and rank layout cannot change them."""
    keys = masks.upload(task_keys(tuple(input_ids.shape), anchor_seed), input_ids.device)
    return task_from_keys(input_ids, loss_mask, keys, objective, seed=anchor_seed)


def task_keys(shape: tuple[int, int], anchor_seed: int) -> torch.Tensor:
    """The micro-batch's anchor keys (CPU), from its seed."""
    return masks.anchor_keys(shape, torch.Generator().manual_seed(anchor_seed))


def task_from_keys(input_ids: torch.Tensor, loss_mask: torch.Tensor, keys: torch.Tensor,
                   objective: ObjectiveConfig, seed: int | None = None) -> BlockTask:
    """`make_task` given its anchor keys on the device: device work only (a CUDA graph replays it).
    `seed`: the micro-batch's, where known (`BlockTask.seed`)."""
    anchors, valid = masks.anchors_from_keys(loss_mask, keys, objective.anchors_per_row(loss_mask.shape[1]))
    # D-PACE weighs the slots in the loss, from the drafter's probabilities: here the mask alone (gamma inf)
    gamma = objective.gamma if objective.slot_weights == "decay" else math.inf
    labels, weights = masks.block_labels(input_ids, loss_mask, anchors, valid, objective.block_size, gamma)
    return BlockTask(input_ids, anchors, valid, labels, weights, seed)


def attention_mask_for(task: BlockTask, block_size: int, context_len: int, use_flex: bool, window: int | None = None):
    if use_flex:
        return masks.flex_block_mask(task.anchors, block_size, context_len, window)
    return masks.dense_mask(task.anchors, block_size, context_len, window)


def draft_hidden(
    drafter: DFlashDraftModel, task: BlockTask, features: torch.Tensor, embed_weight: torch.Tensor, use_flex: bool,
    block_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Final hidden states [b, N*B, H] of every anchor's block, each attending to the context
    strictly before its anchor and to its own block. `block_ids`: the blocks' tokens
    (`masks.block_inputs`), where the caller has them already."""
    cfg = drafter.config
    b, t = task.input_ids.shape
    if block_ids is None:
        block_ids = masks.block_inputs(task.input_ids, task.anchors, cfg.block_size, cfg.mask_token_id)
    ctx_pos = torch.arange(t, device=features.device).expand(b, t)
    blk_pos = masks.block_positions(task.anchors, cfg.block_size)
    mask = attention_mask_for(task, cfg.block_size, t, use_flex, cfg.sliding_window)
    return drafter(features, embed_weight[block_ids], ctx_pos, blk_pos, mask)


def split_features(stream: torch.Tensor, num_layers: int, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The captured stream -> (the drafter's features [b, T, K*H], the target's final-normed hidden
    states [b, T, H] or None). The final states ride as one extra layer when the loss distils."""
    width = num_layers * hidden_size
    if stream.shape[-1] == width:
        return stream, None
    if stream.shape[-1] != width + hidden_size:
        raise ValueError(f"feature stream of width {stream.shape[-1]}: expected {width} or {width + hidden_size}")
    return stream[..., :width], stream[..., width:]


def draft_loss(
    drafter: DFlashDraftModel,
    task: BlockTask,
    stream: torch.Tensor,
    embed_weight: torch.Tensor,
    lm_head,
    use_flex: bool,
    ce_chunk_size: int,
    mix: LossMix = LossMix(),
    target_logits_fn=None,
    compiled_loss: bool = False,
    ce_kernel: str = "chunked",
    even_chunks: bool = False,
) -> BlockLoss:
    """`lm_head`: the target's head as `block_loss` takes it. `stream`: the drafter's features, followed
    by the target's final hidden states when `mix` distils from the target (see `split_features`).
    `even_chunks`: see `block_loss`."""
    cfg = drafter.config
    features, final = split_features(stream, len(cfg.target_layer_ids), cfg.hidden_size)
    if mix.needs_target and final is None:
        raise ValueError("the loss distils from the target but the feature stream has no final hidden states")
    block_ids = masks.block_inputs(task.input_ids, task.anchors, cfg.block_size, cfg.mask_token_id)
    hidden = draft_hidden(drafter, task, features, embed_weight, use_flex, block_ids)
    target_hidden = None
    if mix.needs_target:
        pos = masks.label_source_positions(task.anchors, cfg.block_size, task.input_ids.shape[1])
        target_hidden = final.gather(1, pos[..., None].expand(-1, -1, final.shape[-1]))
    selector = None
    if mix.selector > 0:
        weights = task.weights if mix.selector_slot_weighted else (task.weights > 0).float()
        selector = selector_inputs(drafter, hidden, block_ids, task.labels, mix.selector * weights)
    bias = drafter.logit_bias(block_ids, task.labels)
    confidence = None
    if mix.confidence > 0:  # DSpark's head reads the hidden states and the Markov codes the bias has
        confidence = (drafter.confidence_logits(hidden.flatten(0, 1), bias.code), mix.confidence * task.weights)
    return block_loss(hidden, lm_head, task.labels, task.weights, cfg.block_size, ce_chunk_size, mix, target_hidden,
                      target_logits_fn, compiled_loss, ce_kernel, even_chunks, selector=selector, bias=bias,
                      confidence=confidence)
