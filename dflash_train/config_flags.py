"""Command-line flags derived from a command's typed settings: no table of flags to keep in step.

Every field of the settings model (config_loader.py) is a flag named by its dotted key, as in YAML
and in `key=value` overrides (`--sampling.temperature 0.7`, `--train.lr 3e-4`), with the field's
docstring as its help and the field's default shown. Commands whose users type short flags
(`generate`, `eval`) also get a short flag per field, `--field-name` (`--temperature`) unless the
field declares its own, `Field(..., json_schema_extra={"flag": "--input"})`; for a top-level field it
replaces the key's flag (`"older_flags"`: names it had before, still read). Two fields claiming one flag fail when the parser is built. Values are read by the field's type: text as given for strings and choices,
`--x`/`--no-x` for booleans, one item per use for lists (repeatable), YAML for anything else; the
loader then validates them like any override.

Flags default to None ("not given"): `with_flag_overrides` turns the given ones into (dotted key,
value) overrides appended to the command's `key=value` overrides, so a flag wins over the YAML file.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Collection, Iterator
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

DEST = "config_flag:"
"""Prefix of a derived flag's argparse destination: the rest is its dotted key."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every flag's default, except where there is none to show (None, off switches) or the
    help already says it in words (e.g. 'default: the drafter's'). The usage line names the flags
    derived from config fields as one `[--KEY VALUE ...]`: their groups below list them."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)

    def _format_usage(self, usage, actions, groups, prefix):
        own = [a for a in actions if not a.dest.startswith(DEST)]
        text = super()._format_usage(usage, own, groups, prefix)
        return text.rstrip("\n") + " [--KEY VALUE ...]\n\n" if len(own) < len(actions) else text


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def config_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(dotted key, field) of every setting of `model`, nested sections walked into."""
    for name, info in model.model_fields.items():
        annotation = _without_none(info.annotation)
        if _is_section(annotation):
            yield from config_fields(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info


def _yaml_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise argparse.ArgumentTypeError(f"not a YAML value: {err}") from None


def _reader(annotation: Any) -> dict:
    """argparse keywords that read a value of `annotation` from the command line."""
    annotation = _without_none(annotation)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if annotation is str:
        return {"type": str}
    if get_origin(annotation) is Literal and all(isinstance(v, str) for v in get_args(annotation)):
        return {"type": str, "choices": list(get_args(annotation))}
    if get_origin(annotation) is list:
        (item,) = get_args(annotation) or (Any,)
        return {"action": "append", "type": _reader(item).get("type", _yaml_value)}
    return {"type": _yaml_value}


def _help(info: FieldInfo, instead_of_default: str | None = None) -> str:
    text = (info.description or "").replace("%", "%%")  # argparse %-formats help
    if instead_of_default:
        return f"{text} ({instead_of_default})"
    default = info.get_default(call_default_factory=True)
    if default is PydanticUndefined or default is None:
        return text
    return f"{text} (default: {str(default).replace('%', '%%')})"


def _section_doc(model: type[BaseModel], section: str) -> str | None:
    for part in section.split("."):
        model = _without_none(model.model_fields[part].annotation)
    return (model.__doc__ or "").strip() or None


def add_config_flags(parser: argparse.ArgumentParser, model: type[BaseModel], *, short: bool = False,
                     no_default: dict[str, str] | None = None, shown: Collection[str] | None = None) -> None:
    """One flag per field of `model` (see the module docstring), grouped by section in --help.
    `no_default`: keys whose field default the command does not use, and what their help says instead.
    `shown`: the keys --help lists (None: all); the others work alike and --help-all lists them."""
    groups: dict[str, Any] = {}
    hidden = 0
    if shown is not None:
        parser.add_argument(HELP_ALL, action="store_true", help="every setting, with its meaning and default")
    for key, info in config_fields(model):
        section, _, name = key.rpartition(".")
        visible = shown is None or key in shown
        hidden += not visible
        if visible and section and section not in groups:
            groups[section] = parser.add_argument_group(f"{section} (config section)", _section_doc(model, section))
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        shorter = (extra.get("flag") or f"--{name.replace('_', '-')}") if short else None
        names = [shorter] if shorter and not section else [n for n in (shorter, f"--{key}") if n]
        names += extra.get("older_flags", []) if short else []  # still read, after the flag's own name
        reader = _reader(info.annotation)
        metavar = {} if "choices" in reader or reader.get("action") is argparse.BooleanOptionalAction else {
            "metavar": names[0].lstrip("-").rpartition(".")[2].replace("-", "_").upper()}
        groups.get(section, parser).add_argument(*names, dest=DEST + key, default=None,
                                                 help=_help(info, (no_default or {}).get(key)) if visible
                                                 else argparse.SUPPRESS, **reader, **metavar)
    if hidden:
        more = f"{hidden} more settings, set less often: --help-all lists every one with its meaning and default."
        parser.epilog = f"{parser.epilog}\n\n{more}" if parser.epilog else more


HELP_ALL = "--help-all"


def asks_help_all(argv: list[str]) -> tuple[bool, list[str]]:
    """(whether `argv` asks for --help-all, `argv` with it as --help): the parser is then built with
    every setting shown (`add_config_flags(shown=None)`) and prints its plain help."""
    return HELP_ALL in argv, [("--help" if a == HELP_ALL else a) for a in argv]


def flag_overrides(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(dotted key, value) of every derived flag given on the command line."""
    return [(dest[len(DEST):], value) for dest, value in vars(args).items()
            if dest.startswith(DEST) and value is not None]


def with_flag_overrides(args: argparse.Namespace) -> argparse.Namespace:
    """For a command with derived flags: `args.overrides` = its `key=value` overrides, then its flags."""
    if any(dest.startswith(DEST) for dest in vars(args)):
        args.overrides = [*(getattr(args, "overrides", None) or []), *flag_overrides(args)]
    return args
