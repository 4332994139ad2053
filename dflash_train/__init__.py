"""dflash-train: train DFlash block-diffusion speculative-decoding drafters."""

__version__ = "0.1.0"
