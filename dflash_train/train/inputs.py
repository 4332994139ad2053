"""A run's inputs: its device, target and tokenized data (for `build` and for `dflash-train capture`)."""

from __future__ import annotations

import torch

from dflash_train.config import RunConfig
from dflash_train.data.dataset import TokenizedDataset, check_training_files, load_training_data
from dflash_train.targets.model import Target, compile_decoder, load_target, resolve_device


def load_inputs(cfg: RunConfig, target: Target | None = None, dataset: TokenizedDataset | None = None
                ) -> tuple[torch.device, Target, TokenizedDataset]:
    """The run's device, target and tokenized data (`target`, `dataset` when the caller holds them):
    the data files are checked before the target loads, then tokenized with its tokenizer."""
    device = resolve_device(cfg.device)
    if dataset is None:
        check_training_files(cfg.data)
    target = target or load_target(cfg.target, device)
    if cfg.target.compile:
        compile_decoder(target)  # a target the caller holds too
    dataset = dataset or load_training_data(cfg.data, target.tokenizer, target.identity["tokenizer"])
    return device, target, dataset
