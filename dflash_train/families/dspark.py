"""DSpark: DFlash plus a semi-autoregressive Markov head, as llama.cpp serves it (`--spec-type
draft-dspark`; dflash_train/draft/dspark.py, docs/design.md#dspark).

Trained in DFlash's block layout (slot 0 holds the verified token, slots 1..B-1 predict), which the
export declares with `sample_from_anchor: false`: llama.cpp's converter otherwise takes a
DFlash-style config for the anchor-first layout, whose slot 0 predicts too."""

from dflash_train.families.spec import FamilySpec

SIZES = ("markov_rank", "confidence_head")


def check_sizes(cfg) -> None:
    if cfg.markov_rank < 1:
        raise ValueError(f"dspark needs a positive markov_rank; got {cfg.markov_rank}")


DSPARK = FamilySpec(name="dspark", model="dflash_train.draft.dspark:DSparkDraftModel",
                    architecture="DSparkDraftModel", size_fields=SIZES, check_sizes=check_sizes,
                    independent_slots=False, warm_starts_from=("dflash",), fp8_drafter=False, logit_bias=True,
                    spec_type="draft-dspark", remote_code=False,  # the transformers modeling file has no Markov head
                    export_keys=(("sample_from_anchor", False), ("markov_head_type", "vanilla")))
