"""Engines by name, from typed registries: what each one runs, why it cannot run a target, and what
runs instead.

A registry maps the names a config takes (`decode.acceptance_cache`, `decode.speed_engine`) to
`Engine`s; `choose` turns the config's value, `auto` included, into one of them. Nothing else
compares engine names: a new engine is one more entry, with its own `problem`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from dflash_train.targets.model import Target

log = logging.getLogger("dflash_train")

Run = TypeVar("Run")


def runs_everywhere(target: Target, temperature: float) -> str | None:
    return None


@dataclass(frozen=True)
class Engine(Generic[Run]):
    run: Run
    """What the engine does; its signature is the registry's."""
    problem: Callable[[Target, float], str | None] = runs_everywhere
    """Why it cannot run `target` at `temperature`, or None."""
    fallback: str | None = None
    """The engine that runs instead when asked for by name and it cannot (said as an error), or None:
    the request is refused."""


@dataclass(frozen=True)
class Chosen(Generic[Run]):
    name: str
    engine: Engine[Run]
    passed_over: str | None
    """Why the engine asked for (or auto's first) does not run, or None."""


def choose(engines: dict[str, Engine[Run]], requested: str, auto: tuple[str, ...], target: Target,
           temperature: float, setting: str) -> Chosen[Run]:
    """The engine `requested` names in `engines` (the config key `setting`); `auto`: the first of
    `auto` that can run the target, the reason the first could not logged."""
    if requested == "auto":
        reasons = {}
        for name in auto:
            if (reasons.setdefault(name, engines[name].problem(target, temperature))) is None:
                first = reasons[auto[0]]
                if first is not None:
                    log.info("%s: not %s, since %s", setting, auto[0], first)
                return Chosen(name, engines[name], first)
        raise ValueError(f"{setting}: no engine of {list(auto)} runs {target.name}: {reasons}")
    if requested not in engines:
        raise ValueError(f"{setting} must be auto or one of {sorted(engines)}, got {requested!r}")
    engine = engines[requested]
    problem = engine.problem(target, temperature)
    if problem is None:
        return Chosen(requested, engine, None)
    if engine.fallback is None:
        raise ValueError(f"{setting}={requested} cannot run {target.name}: {problem}")
    log.error("%s=%s cannot run %s: %s; using %s", setting, requested, target.name, problem, engine.fallback)
    return Chosen(engine.fallback, engines[engine.fallback], problem)
