"""How every command reads its settings: typed sections, a YAML file, then dotted overrides.

A command's settings are one pydantic model built from `Section`s. `load` reads the YAML file (if
any), applies the overrides in order (`train.lr=3e-4` text, or (key, value) pairs from command-line
flags, see config_flags.py) and validates the result strictly: an unknown key is an error naming
it (a typo must not silently fall back to a default), and so is every wrong value.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    pass


class Section(BaseModel):
    """Base of every config section: unknown keys rejected, assignments validated, and each field's
    docstring kept as its description (the help of its command-line flag)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    def _not_both(self, section: str, a: str, b: str, why: str) -> None:
        """Keys `a` and `b` exclude each other: setting both is an error naming both."""
        if getattr(self, a) is not None and getattr(self, b) is not None:
            raise ValueError(f"{section}.{a} and {section}.{b} both set: {why}")


Model = TypeVar("Model", bound=BaseModel)
Override = str | tuple[str, Any]
"""`section.key=value` text (the value read as YAML), or an already typed (dotted key, value)."""


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=3e-4` -> ("train.lr", 0.0003); values are parsed as YAML scalars/lists."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{text}' is not of the form section.key=value")
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def override_pairs(overrides: Iterable[Override] | Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """(dotted key, value, how to name it in an error) of each override."""
    if isinstance(overrides, Mapping):
        return [(key, value, f"override '{key}'") for key, value in overrides.items()]
    return [(*parse_override(o), f"override '{o}'") if isinstance(o, str) else (*o, f"override '{o[0]}'")
            for o in overrides]


def set_dotted(tree: dict, dotted: str, value: Any, source: str) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for i, key in enumerate(parents):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: '{'.'.join(parents[: i + 1])}' is not a section")
        node = child
    node[leaf] = value


def format_validation_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown key")
        elif e["type"] == "missing":
            lines.append(f"  {loc}: required, not given")
        else:
            lines.append(f"  {loc}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def read_yaml_tree(path: str | Path | None, default_source: str) -> tuple[dict, str]:
    """(mapping, source name) of a YAML config file; no file -> ({}, default_source)."""
    if path is None:
        return {}, default_source
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return tree, str(path)


def build(model: type[Model], tree: Mapping | None = None, overrides: Iterable[Override] | Mapping[str, Any] = (),
          source: str = "<dict>") -> Model:
    """`tree` (left as it is) with each override applied in order, validated as `model`."""
    tree = copy.deepcopy(dict(tree or {}))
    for key, value, label in override_pairs(overrides):
        set_dotted(tree, key, value, label)
    try:
        return model.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_errors(err, source)) from None


def load(model: type[Model], path: str | Path | None = None,
         overrides: Iterable[Override] | Mapping[str, Any] = ()) -> Model:
    """The YAML file at `path` (none: the defaults), then `overrides`, validated as `model`."""
    tree, source = read_yaml_tree(path, "<defaults>")
    return build(model, tree, overrides, source)
