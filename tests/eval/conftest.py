"""Fixtures for the eval tests."""

import os

import pytest
import torch

from .tiny_models import tiny_drafter, tiny_target

# The embedded SmolLM2 is converted from GGUF once (~25 s); keep it across test runs.
os.environ.setdefault("DFLASH_TRAIN_CACHE", "/work/.cache-dflash")


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target):
    return tiny_drafter(target)


@pytest.fixture(scope="session")
def smollm2():
    from dflash_train.config import TargetConfig
    from dflash_train.target import load_target

    return load_target(TargetConfig(path="smollm2"), torch.device("cpu"))
