"""dflash-train: train DFlash block-diffusion speculative-decoding drafters."""

from dflash_train.pinned_memory import pin_by_registering

__version__ = "0.1.0"

pin_by_registering()  # before any of our modules imports torch (pinned_memory.py says why)
