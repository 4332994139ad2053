"""DSpark: the DFlash drafter plus a Markov head that biases each slot's logits by the token before it.

llama.cpp is the reference (`build_dspark_markov_head` in src/models/dflash.cpp, the draft loop of
`common_speculative_impl_draft_dflash` in common/speculative.cpp); names and shapes are its
converter's (conversion/qwen.py `DSparkModel`), so an export converts and serves there:

- **Markov head**: `markov_w1` [V, R] gives the previous token's code, `markov_w2` [V, R] projects it
  onto the vocabulary; slot p's logits are the backbone's (its final hidden state through the
  target's LM head, before any logit scaling) plus `markov_w2 @ markov_w1[prev]`.
- **Layout**: DFlash's. Slot 0 holds the verified token, slots 1..B-1 predict; slot 1's previous token
  is slot 0's, each later slot's is the token picked at the slot before it (the export says so with
  `sample_from_anchor: false`, else llama.cpp's converter takes the anchor-first layout).
- **Greedy drafting** is a chain: a slot's pick is the argmax of its biased logits, and it is the next
  slot's previous token. So the slots are not independent; the backbone still runs once per block.
- **Training** conditions each slot on its true previous token (teacher forcing), as speculators and
  SpecForge do: a round's later slots count only while the earlier ones were right, and then the
  chain's previous tokens are the true ones. The bias enters the chunked LM-head pass
  (draft/logit_bias.py), so every per-slot term (ce, target_argmax, kl) trains the head with the backbone.

- **Confidence head** (optional, `draft.dspark.confidence_head`): `confidence_head.proj` [1, H + R] with a
  bias; slot p's confidence is `sigmoid(proj . [h_p, markov_w1[prev]] + b)`, h_p the final-normed
  hidden state. llama.cpp reads it with `--spec-draft-p-min P` > 0 and ends the draft at the first slot
  below P (`draft_limits`). Trained with `objective.loss.confidence` (draft/loss.py): BCE against the
  slot's greedy acceptance, from the features the Markov head's code already has.

A DSpark drafter whose `markov_w2` is zero drafts exactly as the DFlash drafter it holds (warm start).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_train.draft import masks
from dflash_train.draft.logit_bias import LogitBias
from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig


class MarkovHead(nn.Module):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)

    def bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """[..., V] the logit bias after previous tokens `prev_ids` [...]."""
        return self.markov_w2(self.markov_w1(prev_ids))


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size + cfg.markov_rank, 1)

    def forward(self, hidden: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """[...] the confidence logits (before the sigmoid) of final hidden states [..., H] after
        previous tokens of code [..., R]: llama.cpp's concatenation order, hidden state first."""
        return self.proj(torch.cat([hidden, code.to(hidden.dtype)], dim=-1)).squeeze(-1)


class DSparkDraftModel(DFlashDraftModel):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg)
        self.confidence_head = ConfidenceHead(cfg) if cfg.confidence_head else None
        self.reset_dspark()

    def reset_parameters(self, std: float = 0.02):
        super().reset_parameters(std)
        if hasattr(self, "markov_head"):  # not yet while the base class builds the layers
            self.reset_dspark()

    def reset_dspark(self) -> None:
        """Random codes and a zero projection: the drafter drafts as DFlash until trained, and the
        projection's first gradient (through the codes) is not zero."""
        with torch.no_grad():
            nn.init.normal_(self.markov_head.markov_w1.weight, std=0.02)
            self.markov_head.markov_w2.weight.zero_()
            if self.confidence_head is not None:  # a confidence of one half until trained
                self.confidence_head.proj.weight.zero_()
                self.confidence_head.proj.bias.zero_()

    def reset_own_parts(self) -> None:
        self.reset_dspark()

    @torch.no_grad()
    def propose_greedy(self, hidden_BQH: torch.Tensor, lm_head_weight: torch.Tensor,
                       block_ids: torch.Tensor) -> torch.Tensor:
        """The drafted tokens [b, Q-1] at temperature 0: slot by slot, the argmax of the slot's logits
        plus the bias after the token picked before it (slot 1: the block's given token)."""
        logits = hidden_BQH[:, 1:] @ lm_head_weight.T  # [b, Q-1, V]
        prev, path = block_ids[:, 0], []
        for i in range(logits.shape[1]):
            biased = logits[:, i] + self.markov_head.bias(prev).to(logits.dtype)
            prev = biased.argmax(-1)
            path.append(prev)
        return torch.stack(path, dim=1)

    @torch.no_grad()
    def draft_limits(self, hidden_BQH: torch.Tensor, lm_head_weight: torch.Tensor, block_ids: torch.Tensor,
                     proposals: torch.Tensor, p_min: float) -> torch.Tensor:
        """[b] drafted tokens kept of `proposals` [b, Q-1] (the greedy chain): those before the first slot
        whose confidence is below `p_min`, as llama.cpp's draft loop cuts them (common/speculative.cpp,
        the `is_dspark` branch). Slot p's previous token is the chain's: the block's given token, then
        the proposal before it."""
        if self.confidence_head is None:
            raise ValueError("decode.draft_p_min > 0 needs a DSpark drafter with a confidence head "
                             "(draft.dspark.confidence_head=true), as llama.cpp refuses one without: set it to 0")
        prev = torch.cat([block_ids[:, :1], proposals[:, :-1]], dim=1)
        conf = torch.sigmoid(self.confidence_head(hidden_BQH[:, 1:], self.markov_head.markov_w1(prev)))
        return (conf >= p_min).long().cumprod(1).sum(1)

    def confidence_logits(self, hidden_RH: torch.Tensor, code_RR: torch.Tensor) -> torch.Tensor:
        """[rows] the confidence head's logits of the loss's rows (hidden states and Markov codes)."""
        return self.confidence_head(hidden_RH, code_RR)

    def logit_bias(self, block_ids_BQ: torch.Tensor, labels_BQ: torch.Tensor) -> LogitBias:
        """The Markov head's bias over the blocks' slots for the chunked loss (draft/logit_bias.py), each
        slot conditioned on its true previous token: the block's given token for slot 1, the label
        before it for the others (slot 0 carries no loss)."""
        prev = masks.true_predecessors(block_ids_BQ, labels_BQ, self.config.block_size)
        return LogitBias(self.markov_head.markov_w1(prev).flatten(0, 1), self.markov_head.markov_w2.weight)
