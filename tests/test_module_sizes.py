"""Modules stay small enough to read whole: none over 400 lines, and the parser is one table read by a
short loop (cli.py build_parser)."""

from __future__ import annotations

import inspect
from pathlib import Path

from dflash_train import cli

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_train"
MAX_LINES = 400


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split along their seams: {long}"


def test_the_parser_is_built_by_a_short_loop_over_the_commands_table():
    assert len(inspect.getsource(cli.build_parser).splitlines()) <= 40
    assert [name for name, *_ in cli.COMMANDS] == list(cli.build_parser().commands)
