"""Per-GPU memory plan of a launch, from the configs alone (no weights loaded): does it fit?

Arithmetic, not a measurement: parameters are counted from the target's HF config, activations are
sketches of the big tensors, plus a flat CUDA context and allocator allowance. On the H200 workload
of docs/benchmarks/multi_gpu.md (Qwen3-8B shape, 3,072 tokens, 512 anchors, block 16) it gives
18.1 GiB for the target GPU and 32.0 for the drafter GPU against 18.9 and 37.7 measured peaks: an
under-estimate of up to ~15%, so a plan near the limit can still need a smaller `data.token_budget`.
Roles: a target GPU holds 1/N of the decoder (N = target.tensor_parallel) plus the replicated
embedding and LM head, a forward's working set and the features waiting to be sent; a drafter GPU
holds the target's embedding and LM head, the drafter in fp32 with its gradients and AdamW's two
moments (16 bytes per parameter), and the received features and drafter activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_train.config import RunConfig
from dflash_train.draft.loss import loss_chunk_rows

GiB = 1024**3
CONTEXT = 2 * GiB
"""CUDA context, cuBLAS workspaces and the caching allocator's slack, per GPU."""


@dataclass(frozen=True)
class RoleMemory:
    role: str
    parts: dict[str, int]  # bytes

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def line(self) -> str:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.parts.items())
        return f"{self.role}: {self.total / GiB:.2f} GiB ({parts})"


def _layer_params(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    return attention + 3 * hidden * intermediate + 2 * hidden


def max_blocks(cfg: RunConfig) -> int:
    """Most blocks one micro-batch draws: rows times anchors a row, over every length a batch can be
    padded to (unbucketed: any length up to max_length; with num_anchors_length the rounding makes
    lengths between the ends the worst)."""
    dc = cfg.data
    lengths = dc.bucket_lengths or range(1, dc.max_length + 1)
    return max(min(dc.max_batch_size, max(1, dc.token_budget // n)) * cfg.objective.anchors_per_row(n) for n in lengths)


def plan_memory(cfg: RunConfig, hf, *, num_features: int, tensor_parallel: int, max_in_flight: int,
                colocated: bool, dtype_bytes: int = 2) -> list[RoleMemory]:
    """`hf`: the target's transformers config; `num_features`: captured layers per micro-batch."""
    h, v, layers = hf.hidden_size, hf.vocab_size, hf.num_hidden_layers
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    hd = getattr(hf, "head_dim", None) or h // heads
    inter = hf.intermediate_size
    tokens = cfg.data.token_budget
    heads_bytes = (1 if getattr(hf, "tie_word_embeddings", False) else 2) * v * h * dtype_bytes
    feature_bytes = tokens * num_features * h * dtype_bytes
    target = {
        "context": CONTEXT,
        "target shard": layers * _layer_params(h, heads, kv, hd, inter) // tensor_parallel * dtype_bytes,
        "embedding+head": heads_bytes,
        # residual, q/k/v and attention output, and the MLP's three intermediate-wide tensors
        "forward": tokens * (4 * h + 3 * inter // tensor_parallel) * dtype_bytes,
        "features queued": feature_bytes * (1 if colocated else max_in_flight + 1),
    }
    d = cfg.draft
    d_inter = d.intermediate_size or inter
    drafter_params = num_features * h * h + d.num_layers * _layer_params(h, heads, kv, hd, d_inter) + 2 * h
    block_tokens = max_blocks(cfg) * cfg.objective.block_size
    drafter = {
        "drafter+grads+AdamW": 16 * drafter_params,
        "features received": 0 if colocated else 2 * feature_bytes,
        # saved per layer for backward: block activations, and K/V over context + blocks
        "activations": d.num_layers * (block_tokens * (6 * h + 3 * d_inter)
                                       + 2 * (tokens + block_tokens) * kv * hd) * 2,
        "logit chunks": 3 * loss_chunk_rows(cfg.objective.ce_chunk_size, v) * v * 4,
    }
    if colocated:  # one context; the drafter's parts join the target's
        return [RoleMemory("colocated GPU (target + drafter)", {**target, **drafter})]
    drafter["context"] = CONTEXT
    drafter["embedding+head"] = heads_bytes
    return [RoleMemory(f"target GPU (1/{tensor_parallel} of the target)" if tensor_parallel > 1 else "target GPU",
                       target), RoleMemory("drafter GPU", drafter)]


def check_fits(roles: list[RoleMemory], gpu_bytes: int) -> None:
    over = [r for r in roles if r.total > gpu_bytes]
    if over:
        raise ValueError(
            "the plan does not fit: " + "; ".join(r.line() for r in over) + f" > {gpu_bytes / GiB:.1f} GiB per GPU. "
            "Raise target.tensor_parallel (target GPUs), lower data.token_budget or data.max_batch_size, "
            "or use a split layout instead of --colocated")
