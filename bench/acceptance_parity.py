"""Does real acceptance equal what training measures? A diagnostic on a real target and drafter.

For each prompt: decode speculatively (greedy), then score the drafter teacher-forced, the way
training does (whole-sequence target features, block masks), on the SAME tokens. Slot-1 accuracy at
the rounds' start positions must equal the real slot-1 acceptance exactly; a gap is a train/inference
mismatch (mask, label or feature off by one). Accuracy over all answer positions is printed beside it.
    python bench/acceptance_parity.py --target smollm2 --drafter runs/quickstart/checkpoints/step_00000096 \
        --prompts runs/quickstart/data/heldout_prompts.jsonl --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash_train.config_model import TargetConfig
from dflash_train.eval.export import load_drafter
from dflash_train.data.prompts import load_prompts
from dflash_train.eval.replay import accepted_prefixes
from dflash_train.eval.report import encode, stop_token_ids
from dflash_train.decode.spec_decode import speculative_generate
from dflash_train.targets.model import load_target


def slot1_hits(target, drafter, seq: torch.Tensor, first: int) -> torch.Tensor:
    """Teacher-forced: does slot 1 of the block anchored at a (a = first .. T-2) predict seq[a+1]?"""
    return accepted_prefixes(target, drafter, seq, first, seq.shape[1] - 1) >= 1


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--num-prompts", type=int)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    target = load_target(TargetConfig(path=args.target, dtype="float32"), device)
    drafter = load_drafter(args.drafter, target, device)
    stops = stop_token_ids(target)
    rounds = accepted = hits_at_starts = hits_all = positions = 0
    for prompt in load_prompts(args.prompts, args.num_prompts):
        ids = encode(target, prompt.messages([]))
        spec = speculative_generate(target, drafter, ids, args.max_new_tokens, stops, 0.0, drafter.config.block_size,
                                    torch.Generator(device=device).manual_seed(0))
        first = ids.shape[1]  # the first answer token is the first round's anchor
        seq = torch.cat([ids, torch.tensor([spec.tokens], device=device)], 1)
        hits = slot1_hits(target, drafter, seq, first).tolist()
        start = first
        for length in spec.acceptance_lengths:
            if start < seq.shape[1] - 1:  # a round cut by the budget or a stop token verified nothing after it
                rounds += 1
                accepted += length >= 2
                hits_at_starts += hits[start - first]
            start += length
        hits_all += sum(hits)
        positions += len(hits)
    result = {"rounds": rounds, "real_slot1_acceptance": accepted / max(rounds, 1),
              "teacher_forced_slot1_at_round_starts": hits_at_starts / max(rounds, 1),
              "teacher_forced_slot1_all_positions": hits_all / max(positions, 1), "positions": positions}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
