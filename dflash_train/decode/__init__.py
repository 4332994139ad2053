"""Decoding: the target alone (greedy and sampled, every engine) and speculatively with a drafter.

Below `generate` (which answers prompts with these decoders) and `eval` (which measures them), which
do not import each other. The target's caches and attention for decoding stay in targets/ (training
shares them).
"""
