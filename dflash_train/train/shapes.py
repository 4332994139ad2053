"""Building a run's parts from the config: the device, and the drafter's shape from the target."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from dflash_train.config import RunConfig
from dflash_train.families import family
from dflash_train.config_training import DataConfig
from dflash_train.data.batching import bucket_shape
from dflash_train.draft.model import DraftModelConfig, target_layer_ids
from dflash_train.targets.model import Target, resolve_mask_token_id


def draft_model_config(cfg: RunConfig, target: Target) -> DraftModelConfig:
    tc = target.model.config
    heads = tc.num_attention_heads
    rope = getattr(tc, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the global layers' base
    layer_ids = target_layer_ids(cfg.draft, target.num_layers)
    target.check_layer_ids(layer_ids)
    return DraftModelConfig(
        hidden_size=target.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or target.hidden_size // heads,
        intermediate_size=cfg.draft.intermediate_size or tc.intermediate_size,
        num_hidden_layers=cfg.draft.num_layers,
        vocab_size=target.vocab_size,
        block_size=cfg.objective.block_size,
        target_layer_ids=list(layer_ids),
        num_target_layers=target.num_layers,
        mask_token_id=resolve_mask_token_id(cfg.objective.mask_token_id, target.tokenizer, target.vocab_size),
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0)),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
        sliding_window=cfg.draft.sliding_window,
        **family_fields(cfg.draft),
    )


def family_fields(draft) -> dict:
    """The DraftModelConfig fields of `draft.family`: its name and its own sizes."""
    return {"family": draft.family, **family(draft.family).sizes_of(draft)}


def stream_layer_ids(cfg: RunConfig, target: Target) -> list[int]:
    """The target layers a micro-batch's feature stream carries: the drafter's, then the last layer
    (its output is the final-normed hidden state) when the loss distils from the target's logits."""
    ids = list(draft_model_config(cfg, target).target_layer_ids)
    return ids + [target.num_layers - 1] if cfg.objective.needs_target_logits else ids


def autocast_for(device: torch.device, target_dtype: torch.dtype) -> AbstractContextManager:
    """bf16 autocast on GPU. On CPU the drafter runs in the target's dtype: fp32 stays exact, and a
    bf16/fp16 target's features and heads would otherwise meet fp32 drafter weights in one matmul."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    low = target_dtype in (torch.bfloat16, torch.float16)
    return torch.autocast("cpu", dtype=target_dtype) if low else nullcontext()


def compile_layers(drafter: torch.nn.Module, num_bucket_shapes: int | None) -> None:
    """torch.compile each draft layer in place (state_dict names unchanged).

    Bucket mode (`num_bucket_shapes`): one static graph per bucket shape (dynamic shapes hit inductor
    bugs in the flex backward on torch 2.11); otherwise dynamo goes dynamic after a first new length.
    """
    static = num_bucket_shapes is not None
    if static:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * num_bucket_shapes + 8)
    for layer in drafter.layers:
        layer.compile(dynamic=False if static else None)


def bucket_shapes(dc: DataConfig) -> list[tuple[int, int]]:
    """(rows, length) of every length bucket's batches (`data.length_bucket` or `data.length_buckets`)."""
    return [bucket_shape(n, dc.buckets, dc.token_budget, dc.max_batch_size) for n in dc.bucket_lengths]


def synthetic_batch(target: Target, stream_layers: list[int], device: torch.device, rows: int, length: int,
                    gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    """Random tokens, a loss mask over the last 3/4 and random features of a bucket's shape: the
    compiled and captured graphs depend on shapes only, and drafter-only ranks of distributed
    training hold no target layers to make real features with."""
    ids = torch.randint(0, target.vocab_size, (rows, length), generator=gen).to(device)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, length // 4 :] = 1
    feats = torch.randn(rows, length, len(stream_layers) * target.hidden_size,
                        generator=gen).to(device, target.embed_weight.dtype)
    return {"input_ids": ids, "loss_mask": loss_mask}, feats
