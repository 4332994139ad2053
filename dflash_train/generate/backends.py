"""What a generation backend is: one async call that answers a conversation.

The regeneration loop only ever awaits `complete`, so HTTP servers and the in-process model are
interchangeable and both get many conversations in flight at once (the local backend batches
whatever is waiting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dflash_train.decode.sampling import GenParams


class GenerationError(Exception):
    """A request that failed for good (after retries, or a 4xx that retrying cannot fix)."""


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
