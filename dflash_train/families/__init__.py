"""Drafting families: each is one `FamilySpec` in a module of this folder, found by name in FAMILIES.

Shared code (the config, the trainer, the decoders, export, eval and serve-check) asks a family's
spec what it needs and never compares a family's name. A spec is plain data and small checks, so the
config stays importable without torch; its model class is named as "module:Class" and loaded by
`dflash_train.draft.build.drafter_for` when a drafter is built.
"""

from __future__ import annotations


from dflash_train.families.dflash import DFLASH
from dflash_train.families.dflash2 import DFLASH2
from dflash_train.families.dspark import DSPARK
from dflash_train.families.spec import FamilySpec

__all__ = ["FAMILIES", "FamilySpec", "by_architecture", "family", "owner_of_size", "term_owner"]

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (DFLASH, DFLASH2, DSPARK)}


def family(name: str) -> FamilySpec:
    if name not in FAMILIES:
        raise ValueError(f"drafter family {name!r}: one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def by_architecture(architecture: str | None, source: str) -> FamilySpec:
    """The family whose export names `architecture` first in its config.json."""
    for spec in FAMILIES.values():
        if spec.architecture == architecture:
            return spec
    names = ", ".join(spec.architecture for spec in FAMILIES.values())
    raise ValueError(f"{source}: architectures[0] is {architecture!r}, not a drafter this package trains ({names})")


def owner_of_size(name: str) -> FamilySpec | None:
    """The family a size field belongs to (None: a field every family has)."""
    return next((spec for spec in FAMILIES.values() if name in spec.size_fields), None)


def term_owner(term: str) -> FamilySpec | None:
    """The family a loss term belongs to (None: a per-slot term every family trains)."""
    return next((spec for spec in FAMILIES.values() if term in spec.loss_terms + spec.optional_loss_terms), None)
