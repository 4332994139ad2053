"""What a drafting family tells the rest of the package (dflash_train/families/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class FamilySpec:
    name: str
    """`draft.family`'s value."""
    model: str
    """"module:Class" of its drafter model (a DFlashDraftModel)."""
    architecture: str
    """`architectures[0]` of its export's config.json: what the engines' loaders and ours dispatch on."""
    options: type | None = None
    """Its own section of the draft config, `draft.<name>` (a config Section, in the family's file): its
    sizes, fields of the drafter's config too (draft/model.py), written to the export's `dflash_config`
    (with `block_size`, which the engines' loaders of such a family read there)."""
    check_sizes: Callable[[Any], None] | None = None
    """Raises ValueError naming what is wrong with the drafter config's sizes for this family."""
    loss_terms: tuple[str, ...] = ()
    """objective.loss terms only this family trains; each is required (left out, its part stays untrained)."""
    optional_loss_terms: tuple[str, ...] = ()
    """objective.loss terms only this family trains, for parts it may leave out (`check_config` pairs them)."""
    check_config: Callable[[Any], None] | None = None
    """Raises ValueError naming what a run config (every section) asks of this family that it cannot do."""
    independent_slots: bool = True
    """Each slot's token is its own argmax or sample: sampled drafting and slot-by-slot replay apply.
    False: the block's tokens are one path (DFlash2's selector walk), greedy only."""
    warm_starts_from: tuple[str, ...] = ()
    """Families whose trained drafter can start this one (`draft.init_from`): its own parts start so
    that it drafts as the one it holds."""
    fp8_drafter: bool = True
    """draft.fp8 is tested with its layers."""
    logit_bias: bool = False
    """Its drafter adds a bias to the slots' logits in the loss (`logit_bias`, draft/logit_bias.py): only
    the chunked kernel forms it, and without D-PACE (the bias's projection gradient is summed over a
    chunk's rows before D-PACE's weights exist)."""
    spec_type: str = "draft-dflash"
    """llama.cpp's `--spec-type` that serves it."""
    remote_code: bool = True
    """The export's transformers modeling file (eval/hf_modeling_dflash.py) defines `architecture`, so
    `AutoModel.from_pretrained(export, trust_remote_code=True)` builds it (config.json's auto_map)."""
    export_keys: tuple[tuple[str, Any], ...] = ()
    """Top-level keys of its export's config.json that the engines' converters read (beyond the
    sizes), as (key, value) pairs."""

    @property
    def size_fields(self) -> tuple[str, ...]:
        """The names of its own sizes (its section's fields)."""
        return tuple(self.options.model_fields) if self.options else ()

    def sizes_of(self, draft) -> dict[str, Any]:
        """Its sizes as set in a draft config section (`draft.<name>`)."""
        return getattr(draft, self.name).model_dump() if self.options else {}

    def starts_from(self, saved_family: str) -> bool:
        """Whether a trained drafter of `saved_family` can warm-start this one."""
        return saved_family in self.warm_starts_from
