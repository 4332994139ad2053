"""DSpark: DFlash plus a semi-autoregressive Markov head, as llama.cpp serves it (`--spec-type
draft-dspark`; dflash_train/draft/dspark.py, docs/design.md#dspark).

Trained in DFlash's block layout (slot 0 holds the verified token, slots 1..B-1 predict), which the
export declares with `sample_from_anchor: false`: llama.cpp's converter otherwise takes a
DFlash-style config for the anchor-first layout, whose slot 0 predicts too."""

from pydantic import Field

from dflash_train.config_loader import Section
from dflash_train.families.spec import FamilySpec


class DSparkOptions(Section):
    """draft.dspark: the sizes of DSpark's Markov head and its optional confidence head."""

    markov_rank: int = Field(64, ge=1)
    """Rank of the Markov head (the previous token's code, vocabulary x rank, projected back to a bias
    on the vocabulary)."""
    confidence_head: bool = False
    """llama.cpp's optional confidence head (`confidence_head.proj`: sigmoid of the final hidden state
    and the previous token's Markov code), which `--spec-draft-p-min` reads to cut a draft short;
    trained by objective.loss.confidence, which it needs (docs/design.md#dspark)."""


def check_config(cfg) -> None:
    """The confidence head and its loss term come together."""
    if (cfg.objective.loss.get("confidence", 0.0) > 0) != cfg.draft.dspark.confidence_head:
        raise ValueError("objective.loss.confidence trains DSpark's confidence head and the head needs it: set "
                         "both or neither (draft.family=dspark draft.dspark.confidence_head=true)")


def check_sizes(cfg) -> None:
    if cfg.markov_rank < 1:
        raise ValueError(f"dspark needs a positive markov_rank; got {cfg.markov_rank}")


DSPARK = FamilySpec(name="dspark", model="dflash_train.draft.dspark:DSparkDraftModel",
                    architecture="DSparkDraftModel", options=DSparkOptions, check_sizes=check_sizes,
                    check_config=check_config, optional_loss_terms=("confidence",),
                    independent_slots=False, warm_starts_from=("dflash",), fp8_drafter=False, logit_bias=True,
                    spec_type="draft-dspark", remote_code=False,  # the transformers modeling file has no Markov head
                    export_keys=(("sample_from_anchor", False), ("markov_head_type", "vanilla")))
