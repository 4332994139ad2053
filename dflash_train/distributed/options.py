"""The options every rank of a distributed run reads, which `launch` passes on to them: named, typed,
defaulted and explained here once. Both parsers add them (launch.py, run.py), and `launch` forwards
the values it was given, so the two command lines cannot drift apart."""

from __future__ import annotations

import argparse

RANK_OPTIONS: dict[str, dict] = {
    "--resume": {"help": "'auto' (the newest step every drafter group holds intact) or a checkpoint dir; "
                         "default: start fresh"},
    "--max-in-flight": {"type": int, "default": 4,
                        "help": "unfinished point-to-point sends per rank before it waits for the oldest"},
    "--heartbeat-timeout": {"type": float, "default": 30.0,
                            "help": "seconds without a peer's heartbeat before the run is stopped"},
}


def add_rank_options(parser: argparse.ArgumentParser) -> None:
    for flag, kwargs in RANK_OPTIONS.items():
        parser.add_argument(flag, **kwargs)


def rank_argv(args: argparse.Namespace) -> list[str]:
    """The ranks' command line for the values in `args` (those set)."""
    argv = []
    for flag in RANK_OPTIONS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            argv += [flag, str(value)]
    return argv
