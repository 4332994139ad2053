"""What a decode is asked (GenParams) and the rule every decoder ends an answer by (emit_tokens)."""

from __future__ import annotations

from dataclasses import dataclass


def emit_tokens(out: list[int], new: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    """Append tokens one by one, exactly as a token-at-a-time decode would; True when finished (a
    stop token appended, or `max_new_tokens` reached). The rule of every decoder here, in generate
    and in eval."""
    for t in new:
        out.append(t)
        if t in stop_ids or len(out) >= max_new_tokens:
            return True
    return False


@dataclass(frozen=True)
class GenParams:
    temperature: float
    top_p: float
    max_tokens: int
    thinking: bool | None = None
    seed: int | None = None

    def batch_key(self) -> tuple:
        """Requests that may share one batched `generate` call (the seed may differ)."""
        return (self.temperature, self.top_p, self.max_tokens, self.thinking)
