"""The DFlash draft model: one self-contained definition, readable top to bottom.

Design choices (they match the format SGLang, vLLM and z-lab load; see docs/design.md#the-drafter):
- Qwen3-style decoder layers: pre-norm RMSNorm, GQA attention with per-head q/k RMSNorm, RoPE,
  SiLU-gated MLP, final `norm`.
- Context = target hidden states of `target_layer_ids`, concatenated [.., K*H] -> `fc` -> `hidden_norm`.
- Injection: in EVERY layer keys/values are k_proj/v_proj of [context ; block], queries come from
  the block only; only block tokens flow through the residual stream. k_norm applies to context and
  block keys alike; values get no norm.
- RoPE at absolute positions: context keys at their token positions, block slot k of anchor a at a+k.
- No embeddings and no LM head: the target's (frozen) are passed in, never stored here.
Shape names: b batch, Q block (query) tokens, C context tokens, H hidden, K captured layers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from torch.utils.checkpoint import checkpoint

from dflash_train.config_model import DraftConfig
from dflash_train.families import FAMILIES, family


@dataclass
class DraftModelConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    """Every layer's keys in a window: a query at position p sees no key at p - W or below (draft/masks.py);
    None: the whole context. Its layer_types are then all `sliding_attention`, as llama.cpp reads them."""
    family: str = "dflash"
    """dflash, dflash2 (draft/dflash2.py: in-block convolutions and a top-k path selector) or dspark
    (draft/dspark.py: a Markov head)."""
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    markov_rank: int = 0
    confidence_head: bool = False

    def __post_init__(self):
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        if not self.layer_types:
            self.layer_types = [kind] * self.num_hidden_layers
        if set(self.layer_types) != {kind}:
            raise ValueError(f"layer_types {sorted(set(self.layer_types))} with sliding_window {self.sliding_window}: "
                             f"every layer is {kind} (one window for all layers)")
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise ValueError(f"sliding_window {self.sliding_window} is shorter than a block of {self.block_size}")
        for i in self.target_layer_ids:
            if not 0 <= i < self.num_target_layers:
                raise ValueError(
                    f"target_layer_ids {self.target_layer_ids}: {i} is outside the target's "
                    f"{self.num_target_layers} layers (ids are 0-based layer outputs)"
                )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside vocabulary {self.vocab_size}")
        spec = family(self.family)
        for other in FAMILIES.values():
            if other is not spec and any(getattr(self, k) for k in other.size_fields):
                raise ValueError(f"{', '.join(other.size_fields)} belong to family {other.name}, not {spec.name}")
        if spec.check_sizes is not None:
            spec.check_sizes(self)

    def to_dict(self) -> dict:
        return asdict(self)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced from 1 to L-3 (Qwen3-8B, 5 layers: [1, 9, 17, 25, 33]); one layer: L//2."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def target_layer_ids(draft: DraftConfig, num_target_layers: int) -> list[int]:
    """The captured target layers: `draft.target_layer_ids` as listed, else `draft.num_target_features`
    (default: the drafter's depth) evenly spaced layers."""
    if draft.target_layer_ids:
        return list(draft.target_layer_ids)
    count = draft.num_target_features or draft.num_layers
    ids = default_target_layer_ids(num_target_layers, count)
    if draft.num_target_features is not None and len(set(ids)) < count:
        raise ValueError(
            f"draft.num_target_features={count}: a {num_target_layers}-layer target has no {count} distinct "
            f"evenly spaced layers (got {ids}); capture fewer or list draft.target_layer_ids"
        )
    return ids


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [b, 1, S, D] for absolute positions [b, S] (rotate-half convention, as HF)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@cache
def _compiled_flex():
    """Wrapped at first use, not at import: `torch.compile` imports inductor (~2 s), which every
    command that imports the drafter (eval, export, launch) would pay without ever compiling.
    Compiled regions never reach it (`_flex_attention` returns first), so no guard can name it: a
    global set after the first trace once cost a recompile (docs/benchmarks/compile.md)."""
    return torch.compile(flex_attention, dynamic=False)  # compiles lazily, at first call


def _flex_attention(on_cuda: bool):
    """flex_attention only runs fused when compiled. Inside an already compiled region (draft layers
    under train.compile) dynamo handles it natively; on CPU (tests, forward only) eager is enough."""
    if torch.compiler.is_compiling() or not on_cuda:
        return flex_attention
    return _compiled_flex()


class DraftKVCache:
    """Per-layer keys/values of the context seen so far (inference only).

    Block keys are never cached: the next round's block is new tokens at new positions.
    """

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def extend(self, layer: int, k_ctx: torch.Tensor, v_ctx: torch.Tensor):
        if self.k[layer] is not None:
            k_ctx = torch.cat([self.k[layer], k_ctx], dim=2)
            v_ctx = torch.cat([self.v[layer], v_ctx], dim=2)
        self.k[layer], self.v[layer] = k_ctx, v_ctx
        return k_ctx, v_ctx

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)  # [b, n, S, D]

    def forward(self, x_BQH, ctx_BCH, rope_q, rope_k, mask, cache=None, layer=0):
        b, q_len, _ = x_BQH.shape
        kv_in = torch.cat([ctx_BCH, x_BQH], dim=1)
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x_BQH), self.num_heads)), *rope_q)
        k = apply_rope(self.k_norm(self._heads(self.k_proj(kv_in), self.num_kv_heads)), *rope_k)
        v = self._heads(self.v_proj(kv_in), self.num_kv_heads)
        if cache is not None:
            c = ctx_BCH.shape[1]
            k_ctx, v_ctx = cache.extend(layer, k[:, :, :c], v[:, :, :c])
            k = torch.cat([k_ctx, k[:, :, c:]], dim=2)
            v = torch.cat([v_ctx, v[:, :, c:]], dim=2)
        if mask is None or isinstance(mask, torch.Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            out = _flex_attention(q.is_cuda)(q, k, v, block_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h_BQH, ctx_BCH, rope_q, rope_k, mask, cache=None, layer=0, block_size: int = 0):
        # The context enters k/v as fc+hidden_norm left it: only block tokens get input_layernorm.
        x = self.input_layernorm(h_BQH)
        h_BQH = h_BQH + self.self_attn(x, ctx_BCH, rope_q, rope_k, mask, cache, layer)
        return h_BQH + self.mlp(self.post_attention_layernorm(h_BQH))


class DFlashDraftModel(nn.Module):
    layer_class = DFlashLayer
    recompute_layers = False
    """Keep only each layer's input for the backward and run the layer again there (`train.activation_checkpointing`):
    a layer's activations grow with the block tokens of a step (anchors x block size), its input alone
    is one [b, Q, H] tensor. Training only; set on the instance."""

    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.config = cfg
        num_ctx = len(cfg.target_layer_ids)
        self.fc = nn.Linear(num_ctx * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def forward(
        self,
        context_BCKH: torch.Tensor,
        block_embeds_BQH: torch.Tensor,
        context_positions: torch.Tensor,
        block_positions: torch.Tensor,
        mask=None,
        cache: DraftKVCache | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [b, Q, H] of the block tokens (logits: target lm_head).

        mask: dense bool [b, 1, Q, C+Q], a flex BlockMask, or None (all visible: inference, where
        every cached and new context token precedes the block).
        """
        cfg = self.config
        ctx = self.hidden_norm(self.fc(context_BCKH))
        dtype = block_embeds_BQH.dtype
        rope_q = rope_cos_sin(block_positions, cfg.head_dim, cfg.rope_theta, dtype)
        rope_k = rope_cos_sin(
            torch.cat([context_positions, block_positions], dim=1), cfg.head_dim, cfg.rope_theta, dtype
        )
        h = block_embeds_BQH
        block_size = self.block_length(h.shape[1])
        recompute = self.recompute_layers and torch.is_grad_enabled() and cache is None
        for i, layer in enumerate(self.layers):
            if recompute:
                h = checkpoint(layer, h, ctx, rope_q, rope_k, mask, None, i, block_size, use_reentrant=False)
            else:
                h = layer(h, ctx, rope_q, rope_k, mask, cache, i, block_size)
        return self.norm(h)

    def reset_own_parts(self) -> None:
        """Reset what its family adds to DFlash so that it drafts as the DFlash drafter whose weights it
        holds (a warm start, `draft.init_from`); DFlash itself adds nothing."""

    def block_length(self, q: int) -> int:
        """Tokens per block in a forward over `q` block tokens (only DFlash2's convolutions need it)."""
        return self.config.block_size

    def propose_greedy(self, hidden_BQH: torch.Tensor, lm_head_weight: torch.Tensor,
                       block_ids: torch.Tensor) -> torch.Tensor:
        """The drafted tokens [b, Q-1] of blocks [b, Q] at temperature 0 (final hidden states of
        `forward`): each slot's argmax over the target's LM head."""
        return (hidden_BQH[:, 1:] @ lm_head_weight.T).argmax(-1)

    def draft_limits(self, hidden_BQH: torch.Tensor, lm_head_weight: torch.Tensor, block_ids: torch.Tensor,
                     proposals: torch.Tensor, p_min: float) -> torch.Tensor:
        """[b] proposals kept when drafting stops below confidence `p_min` (decode.draft_p_min): only a
        drafter with a confidence (DSpark's head, DFlash2's selector) has one."""
        raise ValueError(f"decode.draft_p_min > 0: a {self.config.family} drafter has no confidence; set it to 0")

    def logit_bias(self, block_ids_BQ: torch.Tensor, labels_BQ: torch.Tensor):
        """A bias its family adds to the slots' logits in the loss (draft/logit_bias.py `LogitBias`,
        DSpark's Markov head), or None."""
        return None
