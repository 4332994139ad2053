"""Tensor parallelism for the frozen target: the model's own plan, applied with DTensor.

transformers' models carry a Megatron-style plan (`config.base_model_tp_plan`): q/k/v, gate and up
projections split by output columns, o and down projections by input rows, so each attention head
and MLP slice stays on one rank and one all-reduce follows each row-wise layer. torch's
`parallelize_module` applies it over a device mesh. We do not call `from_pretrained(tp_plan=...)`:
in transformers 5.24 its mesh must span the whole world, while our target groups are a subset of the
ranks (drafter ranks are the rest), and its arguments moved between 5.17 and 5.24.

Each rank of a group loads the checkpoint on CPU (safetensors are memory-mapped: a node's ranks share
the page cache) and keeps only its shards on its GPU. Only the decoder layers are sharded; the
embedding, norms and LM head are replicated (features need the decoder only). Rows of the outputs
are plain replicated tensors, so capture hooks and the feature stream are unchanged.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
FROZEN_NO_OP = {"replicated_with_grad_allreduce"}
"""Replicated weights (Qwen3's q_norm/k_norm) whose gradients a trainer would all-reduce: the frozen
target has none, so leaving them as they are is the style."""


def tensor_parallel_plan(config, n: int) -> dict[str, str]:
    """The model's plan for `n` shards, or ValueError naming what makes it unshardable."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not plan:
        raise ValueError(f"target.tensor_parallel {n}: {config.model_type} has no tensor-parallel plan "
                         "(config.base_model_tp_plan); use 1")
    unknown = sorted({s for s in plan.values() if s not in STYLES and s not in FROZEN_NO_OP})
    if unknown:
        raise ValueError(f"target.tensor_parallel {n}: {config.model_type}'s plan uses {unknown}; supported: "
                         f"{sorted(STYLES)} (dense attention and MLP; mixture-of-experts plans are not)")
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate_size": config.intermediate_size}
    uneven = {k: v for k, v in sizes.items() if v % n}
    if uneven:
        raise ValueError(f"target.tensor_parallel {n} does not divide the target's {uneven}")
    return {pattern: style for pattern, style in plan.items() if style in STYLES}


def shard_decoder(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shards the decoder layers over the 1-D `mesh` in place; the shards land on the mesh's device."""
    plan = tensor_parallel_plan(model.config, mesh.size())
    parallelize_module(model.get_decoder(), mesh, {k: STYLES[v]() for k, v in plan.items()})
