"""What a generation backend is: one async call that answers a conversation.

The regeneration loop only ever awaits `complete`, so HTTP servers and the in-process model are
interchangeable and both get many conversations in flight at once (the local backend batches
whatever is waiting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


def emit_tokens(out: list[int], new: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    """Append tokens one by one, exactly as a token-at-a-time decode would; True when finished (a
    stop token appended, or `max_new_tokens` reached). The rule of every decoder here, in generate
    and in eval."""
    for t in new:
        out.append(t)
        if t in stop_ids or len(out) >= max_new_tokens:
            return True
    return False


class GenerationError(Exception):
    """A request that failed for good (after retries, or a 4xx that retrying cannot fix)."""


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


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    """"stop" or "length" (cut at max_tokens)."""
    reasoning: str | None = None
    """Separate reasoning text when the server splits it out (SGLang/vLLM reasoning parsers)."""


class Backend(Protocol):
    async def identity(self) -> dict:
        """What answers: model name, backend, chat template hash where known."""

    async def complete(self, messages: list[dict], params: GenParams) -> Completion:
        """Answer `messages` (last one a user turn); raises GenerationError."""

    async def aclose(self) -> None: ...
