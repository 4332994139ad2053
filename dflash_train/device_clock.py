"""Marks on the device's timeline, read later without stalling the stream that made them."""

from __future__ import annotations

import time

import torch


class DeviceClock:
    """Marks on the device's timeline: CUDA events on a GPU (no sync until read), wall time on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def passed(self, mark) -> bool:
        """Whether the device has reached `mark` (never blocks)."""
        return not self.cuda or mark.query()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a
