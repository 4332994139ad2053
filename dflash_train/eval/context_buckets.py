"""Acceptance by the context's length at each round: the failure users of long-context targets report
is a drafter whose acceptance falls as the context grows, which one tau over a set hides.

A round drafts from the end of its context: the prompt (earlier turns included) and the answer's
tokens so far. Each round emits its acceptance length in tokens, so round i of an answer starts at
`prompt_tokens + sum(lengths[:i])`: the decoders' records are enough, no decoder changes.
"""

from __future__ import annotations

from bisect import bisect_right

EDGES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
"""Upper ends of the buckets, in tokens: doubling from 1K, as long-context results are reported."""


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens else "0"


def bucket_names() -> list[str]:
    lows = (0, *EDGES)
    return [f"{_k(lo)}-{_k(hi)}" for lo, hi in zip(lows, EDGES)] + [f"{_k(EDGES[-1])}+"]


class ContextTally:
    """Rounds and accepted tokens per bucket of context length."""

    def __init__(self):
        self.rounds = [0] * (len(EDGES) + 1)
        self.accepted = [0] * (len(EDGES) + 1)

    def add(self, prompt_tokens: int, lengths: list[int]) -> None:
        """One answer's rounds, in order, after a prompt of `prompt_tokens`."""
        position = prompt_tokens
        for n in lengths:
            b = bisect_right(EDGES, position)
            self.rounds[b] += 1
            self.accepted[b] += n
            position += n

    def rows(self) -> list[dict]:
        """The buckets with rounds in them: {"context", "rounds", "tau"}."""
        return [{"context": name, "rounds": r, "tau": a / r}
                for name, r, a in zip(bucket_names(), self.rounds, self.accepted) if r]
