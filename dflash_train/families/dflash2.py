"""DFlash2: DFlash plus in-block grouped convolutions and a top-k path selector, as SGLang, vLLM and
llama.cpp serve it (dflash_train/draft/dflash2.py, docs/design.md#dflash2)."""

from pydantic import Field

from dflash_train.config_loader import Section
from dflash_train.families.spec import FamilySpec


class DFlash2Options(Section):
    """draft.dflash2: the sizes of DFlash2's convolutions and path selector."""

    conv_kernel_size: int = Field(2, ge=1)
    """Taps of each in-block convolution (the published drafters use 2)."""
    conv_group_size: int = Field(64, ge=1)
    """Channels sharing one per-token coefficient; must divide the hidden size."""
    selector_rank: int = Field(64, ge=1)
    """Rank of the selector's predecessor/successor codebooks (vocabulary x rank each)."""
    selector_top_k: int = Field(4, ge=1)
    """Candidates per position the selector chooses among."""


def check_sizes(cfg) -> None:
    sizes = tuple(getattr(cfg, k) for k in DFlash2Options.model_fields)
    if min(sizes) < 1 or cfg.hidden_size % cfg.conv_group_size:
        raise ValueError(f"dflash2 needs positive conv_kernel_size, conv_group_size (dividing hidden_size "
                         f"{cfg.hidden_size}), selector_rank and selector_top_k; got {sizes}")
    if cfg.hidden_size < cfg.selector_top_k * (cfg.selector_top_k + 1):
        raise ValueError(f"selector_top_k {cfg.selector_top_k}: llama.cpp packs k*(k+1) selector scores "
                         f"into a row of hidden_size {cfg.hidden_size}")


DFLASH2 = FamilySpec(name="dflash2", model="dflash_train.draft.dflash2:DFlash2DraftModel",
                     architecture="DFlash2DraftModel", options=DFlash2Options, check_sizes=check_sizes,
                     loss_terms=("selector",), independent_slots=False, warm_starts_from=("dflash",),
                     fp8_drafter=False)
