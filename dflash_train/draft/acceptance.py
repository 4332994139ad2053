"""What a micro-batch's blocks tell about acceptance: per-slot correct, counted and accepted
predictions (`BlockLoss`, formed by the chunked loss, draft/loss.py), their sums over a step
(`LossTally`, on the device) and the metrics the training log and the held-out probe print.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockLoss:
    weighted_ce_sum: torch.Tensor
    """sum_k w_k * loss_k over this micro-batch: divide by the GLOBAL weight sum before backward."""
    correct_per_slot: torch.Tensor
    """[B] correct predictions per block slot (slot 0 always 0): the drafter's argmax equals the
    target's when the target's logits are computed, else the data token."""
    counted_per_slot: torch.Tensor
    """[B] predictions that count per slot."""
    accepted_per_slot: torch.Tensor
    """[B] entry k >= 1: blocks whose slots 1..k are all correct (a round started at that anchor
    would accept k drafted tokens); entry 0: blocks whose slot 1 counts. Unlike the per-slot
    accuracies, this keeps the slots' errors together as real verification sees them."""


def block_statistics(total: torch.Tensor, correct: torch.Tensor, counted: torch.Tensor, block_size: int) -> BlockLoss:
    """The per-slot statistics of per-row `correct` and `counted` [rows] (zeros where nothing counts)."""
    blocks = correct.view(-1, block_size)
    anchors = counted.view(-1, block_size)[:, 1:2]
    accepted = torch.cat([anchors, torch.cumprod(blocks[:, 1:], 1) * anchors], 1).sum(0)
    return BlockLoss(
        weighted_ce_sum=total,
        correct_per_slot=blocks.sum(0),
        counted_per_slot=counted.view(-1, block_size).sum(0),
        accepted_per_slot=accepted,
    )


class LossTally:
    """Sums of `BlockLoss` over micro-batches, on the device (no host sync): the weighted loss
    (detached) and the per-slot correct, counted and accepted predictions."""

    def __init__(self, block_size: int, device: torch.device):
        self.loss_sum = torch.zeros((), device=device)
        self.correct = torch.zeros(block_size, device=device)
        self.counted = torch.zeros(block_size, device=device)
        self.accepted = torch.zeros(block_size, device=device)

    def add(self, out: BlockLoss) -> None:
        self.loss_sum += out.weighted_ce_sum.detach()
        self.correct += out.correct_per_slot
        self.counted += out.counted_per_slot
        self.accepted += out.accepted_per_slot


def acceptance_metrics(correct_per_slot: torch.Tensor, counted_per_slot: torch.Tensor,
                       accepted_per_slot: torch.Tensor) -> dict:
    """Per-slot accuracy acc_k (k = 1..B-1), tau_hat = 1 + sum_k prod_{j<=k} acc_j, and tau_accept.

    tau_hat estimates tokens per block (incl. the bonus token) if slot errors were independent;
    tau_accept is the mean of 1 + the accepted prefix over the blocks themselves: what a round
    started at each anchor would give, teacher-forced. Real decoding starts its rounds where the
    last one ended, not at random anchors, so it can read lower where acceptance varies along an answer.
    """
    acc = (correct_per_slot[1:] / counted_per_slot[1:].clamp(min=1)).double().cpu()
    tau_hat = 1.0 + torch.cumprod(acc, 0).sum().item()
    accepted = accepted_per_slot.double().cpu()
    tau_accept = 1.0 + (accepted[1:].sum() / accepted[0].clamp(min=1)).item()
    return {"acc": [round(a, 5) for a in acc.tolist()], "tau_hat": tau_hat, "tau_accept": tau_accept}
