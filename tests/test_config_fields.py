"""No silent keys: every field of every config section is read somewhere in the package.

A declared key that nothing reads accepts a value and does nothing, the silent fallback the typed
config exists to prevent. The check reads the package's syntax trees outside the modules that
declare the configs: the field's name must occur as an attribute (`x.name`), a string key
(`x["name"]`, `getattr(x, "name")`) or a keyword argument (`f(name=...)`). Comments and docstrings
that mention a key do not count.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest
from pydantic import BaseModel

from dflash_train.config import RunConfig
from dflash_train.eval.config import EvalJobConfig
from dflash_train.generate.config import GenerateConfig

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_train"
DECLARING = {PACKAGE / "config.py", PACKAGE / "config_model.py", PACKAGE / "config_training.py",
             PACKAGE / "generate" / "config.py", PACKAGE / "eval" / "config.py"}

READ_INDIRECTLY: dict[str, str] = {
    "data.length_bucket": "read by DataConfig.buckets and .bucket_lengths, which batching and training call",
    "data.length_buckets": "read by DataConfig.buckets and .bucket_lengths, which batching and training call",
    "objective.num_anchors_length": "read by ObjectiveConfig.anchors_per_row, which draft/objective.py calls",
}
"""dotted key -> why it is read without its name being written out outside the declaring modules (a
section's own method reads it). An entry without a reason is not allowed."""


def sections(model: type[BaseModel], prefix: str):
    """(dotted key, field name) of every field of `model` and of the sections nested in it."""
    for name, info in model.model_fields.items():
        yield f"{prefix}{name}", name
        annotation = info.annotation
        for candidate in (annotation, *getattr(annotation, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                yield from sections(candidate, f"{prefix}{name}.")


@cache
def names_read() -> frozenset[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path in DECLARING:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                found.add(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                found.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return frozenset(found)


FIELDS = sorted(set(sections(RunConfig, "")) | {(f"generate:{k}", n) for k, n in sections(GenerateConfig, "")}
                | {(f"eval:{k}", n) for k, n in sections(EvalJobConfig, "")})


@pytest.mark.parametrize("key,name", FIELDS, ids=[k for k, _ in FIELDS])
def test_every_config_field_is_read(key, name):
    if key in READ_INDIRECTLY:
        return
    assert name in names_read(), f"config key {key} is declared but never read in dflash_train/"


def test_the_declaring_modules_exist():
    """A config module that moved must move here too, or its own declarations would count as reads."""
    assert all(path.is_file() for path in DECLARING), [str(p) for p in DECLARING if not p.is_file()]


def test_the_indirect_readers_are_called_in_the_package():
    """A key in READ_INDIRECTLY is read by a section's method: that method must be called outside the
    declaring modules, or the key is as silent as an unread one."""
    readers = {"buckets", "bucket_lengths", "anchors_per_row"}
    assert readers <= names_read()
