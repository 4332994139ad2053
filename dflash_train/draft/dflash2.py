"""DFlash2: the DFlash drafter plus in-block convolutions and a top-k path selector.

The serving engines are the reference (vLLM 0.33 `qwen3_dflash2.py`, llama.cpp `src/models/dflash.cpp`
and `common/speculative.cpp`); names and shapes are theirs, so an export loads in both:

- **Grouped convolution** around each attention and MLP sublayer, along the block's positions only
  (a block never reads another block or the context). For the sublayer input `x` (after its norm),
  `kernel_projection(x)` gives per-token coefficients `[2, taps, groups]`: side 0 convolves `x`
  before the sublayer, side 1 its output after. Output at block position `p`:
  `sum_{tap <= p} (base_kernel[side, tap, c] + coeff[p, side, tap, group(c)]) * x[p - tap, c]`.
- **Candidate selector** over each position's top-k candidates of the draft logits: the score of
  candidate `c` after predecessor `q` at position `p` is `logit_p(c) + sum_r predecessor[q, r] *
  gate_p[r] * successor[c, r]`, with `gate_p = hidden_projection(h_p)` (the final-normed hidden).
  Position 1's predecessor is the block's given token; later positions take the candidates of the
  position before. Greedy decoding walks the block left to right, each position picking the best
  candidate after the one picked before it.

A DFlash2 drafter whose convolutions are identity (`base_kernel[:, 0] = 1`, the rest 0) and whose
successor codebook is zero drafts exactly as the DFlash drafter it holds (warm start, `from_dflash`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.draft import masks
from dflash_train.draft.grouped_conv_kernel import grouped_conv
from dflash_train.draft.model import DFlashDraftModel, DFlashLayer, DraftModelConfig
from dflash_train.draft.selector_loss import SelectorInputs

ALIGNED_OUTPUTS = 8
"""A bf16 row of a multiple of 8 values is 16 bytes: the alignment cuBLAS's fast kernels need."""


class GroupedConv(nn.Module):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        h, self.taps, self.group_size = cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size
        self.num_groups = h // self.group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, h))
        self.kernel_projection = nn.Linear(h, 2 * self.taps * self.num_groups, bias=False)

    def coefficients(self, x_BQH: torch.Tensor) -> torch.Tensor:
        """Per-token coefficients [b, Q, 2, taps, groups] of both sides, from the sublayer's input."""
        outputs = self.kernel_projection.out_features
        if outputs % ALIGNED_OUTPUTS == 0:  # the module itself (FP8 may have swapped it)
            coeff = self.kernel_projection(x_BQH)
        else:
            # The few outputs (2 x taps x groups, 36 in the recipe) padded with zero rows, so each
            # token's row of the product is 16-byte aligned: at 36, cuBLAS takes its slow
            # 2-element-aligned kernels for the product and both of its gradients.
            weight = F.pad(self.kernel_projection.weight, (0, 0, 0, -outputs % ALIGNED_OUTPUTS))
            coeff = F.linear(x_BQH, weight)[..., :outputs]
        return coeff.unflatten(-1, (2, self.taps, self.num_groups))

    def convolve(self, x_BQH: torch.Tensor, coeff: torch.Tensor, side: int, block_size: int) -> torch.Tensor:
        if x_BQH.is_cuda:  # one kernel each way (draft/grouped_conv_kernel.py); the ops below are its reference
            return self.convolve_kernel(x_BQH, coeff, side, block_size)
        return self.convolve_ops(x_BQH, coeff, side, block_size)

    def convolve_kernel(self, x_BQH: torch.Tensor, coeff: torch.Tensor, side: int, block_size: int) -> torch.Tensor:
        if torch.is_autocast_enabled(x_BQH.device.type):
            # The kernel reads and writes the dtype the sublayer's matmuls take: fed the norm's fp32
            # output, it would move twice the bytes each way and a cast pass would follow it.
            x_BQH = x_BQH.to(torch.get_autocast_dtype(x_BQH.device.type))
        b, q, h = x_BQH.shape
        coeff = coeff[:, :, side].reshape(b * q, self.taps, self.num_groups).contiguous()
        return grouped_conv(x_BQH.reshape(b * q, h).contiguous(), coeff, self.base_kernel[side],
                            block_size).view(b, q, h)

    def convolve_ops(self, x_BQH: torch.Tensor, coeff: torch.Tensor, side: int, block_size: int) -> torch.Tensor:
        b, q, h = x_BQH.shape
        blocks = x_BQH.view(b, q // block_size, block_size, self.num_groups, self.group_size)
        base = self.base_kernel[side].view(self.taps, self.num_groups, self.group_size).to(x_BQH.dtype)
        coeff = coeff[:, :, side].reshape(b, q // block_size, block_size, self.taps, self.num_groups, 1)
        # Tap by tap, the token's weights never stacked into one [tokens, taps, hidden] tensor: its
        # gradient would be formed whole before its two reductions (to the base kernel and the coefficients).
        out = (base[0] + coeff[:, :, :, 0]) * blocks
        for tap in range(1, min(self.taps, block_size)):  # a tap past the block reads only its left padding
            shifted = F.pad(blocks[:, :, :-tap], (0, 0, 0, 0, tap, 0))
            out = out + (base[tap] + coeff[:, :, :, tap]) * shifted
        return out.reshape(b, q, h)


class DFlash2Layer(DFlashLayer):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__(cfg)
        self.attention_conv = GroupedConv(cfg)
        self.mlp_conv = GroupedConv(cfg)

    def forward(self, h_BQH, ctx_BCH, rope_q, rope_k, mask, cache=None, layer=0, block_size: int = 0):
        x = self.input_layernorm(h_BQH)
        coeff = self.attention_conv.coefficients(x)
        x = self.attention_conv.convolve(x, coeff, 0, block_size)
        attn = self.self_attn(x, ctx_BCH, rope_q, rope_k, mask, cache, layer)
        h_BQH = h_BQH + self.attention_conv.convolve(attn, coeff, 1, block_size)
        y = self.post_attention_layernorm(h_BQH)
        coeff = self.mlp_conv.coefficients(y)
        y = self.mlp(self.mlp_conv.convolve(y, coeff, 0, block_size))
        return h_BQH + self.mlp_conv.convolve(y, coeff, 1, block_size)


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def candidates(self, logits_BPV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, logits) [b, P, k] of each position's top-k candidates."""
        unary, ids = logits_BPV.topk(self.top_k, dim=-1)
        return ids, unary

    def scores(self, hidden_BPH: torch.Tensor, unary_BPK: torch.Tensor, candidate_ids: torch.Tensor,
               predecessor_ids: torch.Tensor) -> torch.Tensor:
        """[b, P, n, k]: the score of candidate c after predecessor q (predecessor_ids [b, P, n])."""
        gate = self.hidden_projection(hidden_BPH)  # [b, P, R]
        pred = self.predecessor_codebook[predecessor_ids] * gate[:, :, None]  # [b, P, n, R]
        succ = self.successor_codebook[candidate_ids]  # [b, P, k, R]
        return unary_BPK[:, :, None] + torch.einsum("bpnr,bpkr->bpnk", pred, succ)

    @torch.no_grad()
    def walk(self, hidden_BPH: torch.Tensor, logits_BPV: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The greedy path [b, P] over positions 1..P of a block (hidden and logits of those
        positions; anchor_ids [b]: the block's given token), as llama.cpp and vLLM draft at T=0."""
        ids, unary = self.candidates(logits_BPV)
        b, p, k = ids.shape
        predecessors = torch.cat([anchor_ids.view(b, 1, 1).expand(b, 1, k), ids[:, :-1]], dim=1)
        scores = self.scores(hidden_BPH, unary, ids, predecessors)  # [b, P, k, k]
        rows = torch.arange(b, device=ids.device)
        chosen = scores[:, 0, 0].argmax(-1)  # position 1: every predecessor row holds the anchor
        path = [ids[rows, 0, chosen]]
        for i in range(1, p):
            chosen = scores[rows, i, chosen].argmax(-1)
            path.append(ids[rows, i, chosen])
        return torch.stack(path, dim=1)

    @torch.no_grad()
    def confidences(self, hidden_BPH: torch.Tensor, logits_BPV: torch.Tensor, anchor_ids: torch.Tensor,
                    path_BP: torch.Tensor) -> torch.Tensor:
        """[b, P] the softmax of each position's scores at their argmax, after the path's previous token
        (the anchor at position 1): the confidence llama.cpp's --spec-draft-p-min reads along the walk."""
        ids, unary = self.candidates(logits_BPV)
        predecessors = torch.cat([anchor_ids[:, None], path_BP[:, :-1]], dim=1)[..., None]  # [b, P, 1]
        return self.scores(hidden_BPH, unary, ids, predecessors)[:, :, 0].softmax(-1).amax(-1)


class DFlash2DraftModel(DFlashDraftModel):
    layer_class = DFlash2Layer

    def __init__(self, cfg: DraftModelConfig):
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg)
        self.reset_dflash2()

    def reset_parameters(self, std: float = 0.02):
        super().reset_parameters(std)
        if hasattr(self, "candidate_selector"):  # not yet while the base class builds the layers
            self.reset_dflash2()

    def reset_dflash2(self) -> None:
        """Identity convolutions, a zero successor codebook: the drafter drafts as DFlash until trained."""
        with torch.no_grad():
            for layer in self.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.zero_()
                    conv.base_kernel[:, 0] = 1.0
                    conv.kernel_projection.weight.zero_()
            sel = self.candidate_selector
            nn.init.normal_(sel.predecessor_codebook, std=0.02)
            sel.successor_codebook.zero_()
            nn.init.normal_(sel.hidden_projection.weight, std=0.02)

    def reset_own_parts(self) -> None:
        self.reset_dflash2()

    def block_length(self, q: int) -> int:
        if q % self.config.block_size:
            raise ValueError(f"DFlash2 drafts whole blocks of {self.config.block_size} tokens, got {q} block tokens")
        return self.config.block_size

    def propose_greedy(self, hidden_BQH: torch.Tensor, lm_head_weight: torch.Tensor,
                       block_ids: torch.Tensor) -> torch.Tensor:
        slots = hidden_BQH[:, 1:]
        return self.candidate_selector.walk(slots, slots @ lm_head_weight.T, block_ids[:, 0])

    def draft_limits(self, hidden_BQH: torch.Tensor, lm_head_weight: torch.Tensor, block_ids: torch.Tensor,
                     proposals: torch.Tensor, p_min: float) -> torch.Tensor:
        """[b] proposals kept of the greedy walk `proposals` [b, Q-1]: those before the first position
        whose selector confidence is below `p_min` (common/speculative.cpp, the `is_dflash2` branch)."""
        slots = hidden_BQH[:, 1:]
        conf = self.candidate_selector.confidences(slots, slots @ lm_head_weight.T, block_ids[:, 0], proposals)
        return (conf >= p_min).long().cumprod(1).sum(1)


def selector_inputs(drafter: DFlash2DraftModel, hidden_BQH: torch.Tensor, block_ids_BQ: torch.Tensor,
                    labels_BQ: torch.Tensor, weights_BQ: torch.Tensor) -> SelectorInputs:
    """The selector's part of the loss over the blocks' slots (draft/selector_loss.py), each slot
    conditioned on its true previous token: the block's given token for slot 1, the label before it
    for the others. `weights_BQ`: each slot's selector weight (0: no loss)."""
    sel = drafter.candidate_selector
    prev = masks.true_predecessors(block_ids_BQ, labels_BQ, drafter.config.block_size)
    # an embedding, not an index: its backward sums a token's repeats in segments, where an index's
    # backward (sorted, then row by row) serialises the many repeats of common tokens in real text
    gate = F.embedding(prev, sel.predecessor_codebook) * sel.hidden_projection(hidden_BQH)
    return SelectorInputs(gate.flatten(0, 1), sel.successor_codebook, weights_BQ.flatten(), sel.top_k)
