"""The decoders' tests use the eval tests' tiny target and drafter and the generate tests' tiny
target saved to disk."""

from tests.eval.conftest import drafter, one_thread, smollm2, smollm2_tokenizer, target  # noqa: F401
from tests.generate.conftest import tiny_target  # noqa: F401
