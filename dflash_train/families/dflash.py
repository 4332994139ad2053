"""DFlash as published in February 2026: a block of slots drafted in one non-causal forward pass,
each slot its own argmax (dflash_train/draft/model.py)."""

from dflash_train.families.spec import FamilySpec

DFLASH = FamilySpec(name="dflash", model="dflash_train.draft.model:DFlashDraftModel",
                    architecture="DFlashDraftModel")
