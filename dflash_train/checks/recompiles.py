"""Count torch.compile graph compilations and keep the guard-failure reason of each recompile.

Steady-state training must not recompile: a recompile costs seconds to minutes and a stream of them
is exactly the silent slowdown this project exists to prevent. The trainer logs `recompiles` as a
metric and, after warm-up, warns with the reason dynamo gives (e.g. "tensor 'x' size mismatch at
index 1. expected 2048, actual 2304").
"""

from __future__ import annotations

import logging

import torch
import torch._logging
from torch._dynamo.utils import counters

_RECOMPILE_LOGGER = "torch._dynamo.guards.__recompiles"


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons.append(record.getMessage())


class RecompileWatch:
    def __init__(self):
        torch._logging.set_logs(recompiles=True)
        self._handler = _Collect()
        logger = logging.getLogger(_RECOMPILE_LOGGER)
        logger.addHandler(self._handler)
        logger.propagate = False  # keep dynamo's multi-line dumps off the console; we report them
        self._warm_mark: int | None = None
        self._reported = 0

    @property
    def graphs(self) -> int:
        """Graphs compiled in this process so far."""
        return int(counters["stats"]["unique_graphs"])

    @property
    def recompiles(self) -> int:
        return len(self._handler.reasons)

    def mark_warm(self) -> None:
        self._warm_mark = self.recompiles
        self._reported = self.recompiles

    @property
    def since_warm(self) -> int:
        return 0 if self._warm_mark is None else self.recompiles - self._warm_mark

    def new_reasons(self) -> list[str]:
        """Reasons of recompiles after warm-up not yet reported."""
        if self._warm_mark is None:
            return []
        fresh = self._handler.reasons[self._reported :]
        self._reported = len(self._handler.reasons)
        return fresh

    def close(self) -> None:
        logging.getLogger(_RECOMPILE_LOGGER).removeHandler(self._handler)
