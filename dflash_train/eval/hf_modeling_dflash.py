"""DFlash and DFlash2 draft models for `AutoModel.from_pretrained(folder, trust_remote_code=True)`.

`dflash-train export` copies this file into the export as `dflash.py`, and config.json's `auto_map`
names `dflash.DFlashDraftModel` or `dflash.DFlash2DraftModel`, as z-lab's published drafters do.
It imports torch and transformers only, so the folder loads where dflash-train is not installed.

The forward is z-lab's: `forward(position_ids, attention_mask=None, noise_embedding=None,
target_hidden=None, past_key_values=None, use_cache=False)` returns the final-normed hidden states
[b, Q, H] of the block (the drafts' logits are the target's LM head of them). `target_hidden`
[b, C, K*H] is the target's captured layers, concatenated; `noise_embedding` [b, Q, H] is the
target's embedding of the block (the verified token, then mask tokens); `position_ids` [b, C+Q]
holds the context's positions, then the block's.

Design (one drafter layer):
- Keys and values are k_proj/v_proj of [context ; block], queries come from the block only; only
  block tokens flow through the residual stream. k_norm applies to context and block keys alike.
- RoPE at absolute positions (rotate-half convention); every token sees every other (no mask), but
  for a sliding window W (`sliding_window` when `use_sliding_window`, on the layers `layer_types`
  calls `sliding_attention`): a query at position p sees no key at position p - W or below, inside
  the block too, as llama.cpp masks it. Keys cached in `past_key_values` sit at the positions just
  below the first of `position_ids` (z-lab's use: the cache holds the context from position 0).
- DFlash2 adds a grouped convolution along the block's positions before and after each sublayer,
  with per-token coefficients, and a candidate selector over each position's top-k drafts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config


def _dflash_config(config: Qwen3Config) -> dict:
    return getattr(config, "dflash_config", None) or {}


def _rope_theta(config: Qwen3Config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}  # transformers 5 moves rope_theta here
    return float(parameters.get("rope_theta") or getattr(config, "rope_theta", None) or 1_000_000.0)


def _sliding_window(config: Qwen3Config) -> int | None:
    return config.sliding_window if getattr(config, "use_sliding_window", False) else None


def window_mask(position_ids: torch.Tensor, num_cached: int, q_len: int, window: int) -> torch.Tensor:
    """Bool [b, 1, Q, num_cached + S] (True = attend) for positions [b, S] whose last Q are the block's:
    a query sees a key fewer than `window` positions below it (the cached keys precede position_ids)."""
    cached = position_ids[:, :1] - num_cached + torch.arange(num_cached, device=position_ids.device)
    keys = torch.cat([cached, position_ids], dim=1)
    return (position_ids[:, -q_len:, None] - keys[:, None, :] < window)[:, None]


def with_window(attention_mask: torch.Tensor | None, window: torch.Tensor) -> torch.Tensor:
    """The caller's mask (bool, or additive floats) narrowed to the window."""
    if attention_mask is None:
        return window
    if attention_mask.dtype == torch.bool:
        return attention_mask & window
    return attention_mask.masked_fill(~window, float("-inf"))


class DFlashRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [b, 1, S, D] for positions [b, S]."""
    exponent = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
    freqs = position_ids[..., None].float() * (1.0 / theta**exponent)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask=None, past_key_values=None):
        b, q_len, _ = hidden_states.shape
        cos, sin = position_embeddings  # context positions, then the block's
        kv_in = torch.cat([target_hidden, hidden_states], dim=1)
        q = self.q_norm(self._heads(self.q_proj(hidden_states), self.num_heads))
        q = apply_rotary(q, cos[:, :, -q_len:], sin[:, :, -q_len:])
        k = apply_rotary(self.k_norm(self._heads(self.k_proj(kv_in), self.num_kv_heads)), cos, sin)
        v = self._heads(self.v_proj(kv_in), self.num_kv_heads)
        if past_key_values is not None:  # z-lab's use: the caller crops the block's keys after each round
            k, v = past_key_values.update(k, v, self.layer_idx)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask=None, past_key_values=None):
        # the context enters keys and values as fc + hidden_norm left it: only block tokens are normed here
        x = self.input_layernorm(hidden_states)
        hidden_states = hidden_states + self.self_attn(x, target_hidden, position_embeddings, attention_mask,
                                                       past_key_values)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer", "DFlash2DecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)


class DFlashDraftModel(DFlashPreTrainedModel):
    decoder_layer = DFlashDecoderLayer

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.target_layer_ids = list(_dflash_config(config)["target_layer_ids"])
        self.block_size = int(getattr(config, "block_size", None) or _dflash_config(config).get("block_size", 16))
        self.mask_token_id = _dflash_config(config).get("mask_token_id")
        self.sliding_window = _sliding_window(config)
        layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
        self.layer_slides = [self.sliding_window is not None and t == "sliding_attention" for t in layer_types]
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(self.decoder_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self._add_modules(config)
        self.post_init()

    def _add_modules(self, config: Qwen3Config) -> None:
        """A subclass's own modules, made before post_init initialises them all."""

    def forward(self, position_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                noise_embedding: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool = False, **kwargs) -> torch.Tensor:
        hidden_states = noise_embedding
        target_hidden = self.hidden_norm(self.fc(target_hidden))
        head_dim = self.layers[0].self_attn.head_dim
        position_embeddings = rotary_cos_sin(position_ids, head_dim, _rope_theta(self.config), hidden_states.dtype)
        cache = past_key_values if use_cache else None
        masks = {False: attention_mask}
        if any(self.layer_slides):
            num_cached = cache.get_seq_length() if cache is not None else 0
            window = window_mask(position_ids, num_cached, hidden_states.shape[1], self.sliding_window)
            masks[True] = with_window(attention_mask, window)
        for layer, slides in zip(self.layers, self.layer_slides):
            hidden_states = layer(hidden_states, target_hidden, position_embeddings, masks[slides], cache)
        return self.norm(hidden_states)


class DFlashGroupedConv(nn.Module):
    """Coefficients [2, taps, groups] per token from the sublayer's input; side 0 convolves the input,
    side 1 the sublayer's output, along the block's positions: out[p] = sum over tap <= p of
    (base_kernel[side, tap] + coeff[p, side, tap]) * x[p - tap]."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        dflash = _dflash_config(config)
        h, self.taps, self.group_size = config.hidden_size, int(dflash["conv_kernel_size"]), int(dflash["conv_group_size"])
        self.num_groups = h // self.group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, h))
        self.kernel_projection = nn.Linear(h, 2 * self.taps * self.num_groups, bias=False)

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel_projection(x).unflatten(-1, (2, self.taps, self.num_groups))

    def convolve(self, x: torch.Tensor, coeff: torch.Tensor, side: int, block_size: int) -> torch.Tensor:
        b, q, h = x.shape
        blocks = x.view(b, q // block_size, block_size, self.num_groups, self.group_size)
        weight = self.base_kernel[side].view(self.taps, self.num_groups, self.group_size).to(x.dtype)
        weight = weight + coeff[:, :, side].view(b, q // block_size, block_size, self.taps, self.num_groups, 1)
        out = weight[:, :, :, 0] * blocks
        for tap in range(1, min(self.taps, block_size)):
            out = out + weight[:, :, :, tap] * F.pad(blocks[:, :, :-tap], (0, 0, 0, 0, tap, 0))
        return out.reshape(b, q, h)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.block_size = int(_dflash_config(config).get("block_size") or config.block_size)
        self.attention_conv = DFlashGroupedConv(config)
        self.mlp_conv = DFlashGroupedConv(config)

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask=None, past_key_values=None):
        x = self.input_layernorm(hidden_states)
        coeff = self.attention_conv.coefficients(x)
        attn = self.self_attn(self.attention_conv.convolve(x, coeff, 0, self.block_size), target_hidden,
                              position_embeddings, attention_mask, past_key_values)
        hidden_states = hidden_states + self.attention_conv.convolve(attn, coeff, 1, self.block_size)
        y = self.post_attention_layernorm(hidden_states)
        coeff = self.mlp_conv.coefficients(y)
        y = self.mlp(self.mlp_conv.convolve(y, coeff, 0, self.block_size))
        return hidden_states + self.mlp_conv.convolve(y, coeff, 1, self.block_size)


class DFlashCandidateSelector(nn.Module):
    """The score of candidate c after predecessor q at a position: its draft logit plus
    sum_r predecessor[q, r] * gate[r] * successor[c, r], gate = hidden_projection(final hidden)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        dflash = _dflash_config(config)
        self.top_k, rank = int(dflash["selector_top_k"]), int(dflash["selector_rank"])
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    @torch.no_grad()
    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The greedy drafts [b, P] of positions 1..P (their final hidden states and draft logits),
        each position picking its best candidate after the one picked before (anchor_ids [b] first)."""
        unary, ids = logits.topk(self.top_k, dim=-1)
        b, p, k = ids.shape
        predecessors = torch.cat([anchor_ids.view(b, 1, 1).expand(b, 1, k), ids[:, :-1]], dim=1)
        gate = self.hidden_projection(hidden)
        pred = self.predecessor_codebook[predecessors] * gate[:, :, None]
        scores = unary[:, :, None] + torch.einsum("bpnr,bpkr->bpnk", pred, self.successor_codebook[ids])
        rows = torch.arange(b, device=ids.device)
        chosen = scores[:, 0, 0].argmax(-1)
        path = [ids[rows, 0, chosen]]
        for i in range(1, p):
            chosen = scores[rows, i, chosen].argmax(-1)
            path.append(ids[rows, i, chosen])
        return torch.stack(path, dim=1)


class DFlash2DraftModel(DFlashDraftModel):
    decoder_layer = DFlash2DecoderLayer

    def _add_modules(self, config: Qwen3Config) -> None:
        self.candidate_selector = DFlashCandidateSelector(config)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DFlashGroupedConv):  # identity convolutions: a fresh DFlash2 drafts as DFlash
            nn.init.zeros_(module.base_kernel)
            with torch.no_grad():
                module.base_kernel[:, 0] = 1.0
            nn.init.zeros_(module.kernel_projection.weight)
