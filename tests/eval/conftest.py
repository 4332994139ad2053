"""Fixtures for the eval tests."""


import pytest
import torch
from transformers import AutoTokenizer

from dflash_train.config_model import TargetConfig
from dflash_train.targets.model import load_target
from dflash_train.targets.tokenizer import resolve_target_path

from .tiny_models import tiny_drafter, tiny_target



@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run op by op: on 2 shared cores a second intra-op thread only adds waits
    (3 ms per small matmul/softmax under load, vs microseconds on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def drafter(target):
    return tiny_drafter(target)


@pytest.fixture(scope="session")
def smollm2():
    return load_target(TargetConfig(path="smollm2"), torch.device("cpu"))


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    return AutoTokenizer.from_pretrained(resolve_target_path("smollm2"))
