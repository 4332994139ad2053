"""Can this run use FP8 matmuls (`draft.fp8`, `target.fp8`, `train.fp8_lm_head`)? A GPU with FP8
tensor cores, torchao installed for the two keys that use it, and layer widths the kernels take."""

from __future__ import annotations

import importlib.util

import torch
from torch import nn


def fp8_problem(device: torch.device) -> str | None:
    """Why torchao's FP8 layers cannot run on `device`, or None when they can."""
    if importlib.util.find_spec("torchao") is None:
        return "FP8 needs torchao: pip install 'dflash-train[fp8]'"
    return fp8_device_problem(device)


def fp8_device_problem(device: torch.device) -> str | None:
    """Why `device` has no FP8 matmuls, or None when it has."""
    if device.type != "cuda":
        return f"FP8 matmuls need a CUDA GPU of compute capability >= 8.9 (the device is {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"FP8 matmuls need compute capability >= 8.9 (Ada, Hopper or later); "
                f"{torch.cuda.get_device_name(device)} has {major}.{minor}")
    return None


def fp8_shaped(linear: nn.Linear) -> bool:
    """The FP8 kernels need both weight dimensions divisible by 16."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0
