"""FP8 training of the drafter's linear layers (`draft.fp8`), through torchao's float8 training.

torchao swaps each `nn.Linear` for a `Float8Linear` that casts its input, weight and gradients to
float8_e4m3fn with dynamic scales and runs the matmuls on the FP8 tensor cores (compute capability
>= 8.9: Ada, Hopper and later). The master weights, the optimizer state and every state_dict key stay
as they were, so checkpoints, resume and export do not change; norms, attention and the loss (the
target's LM head) keep their bf16 path. Recipes, by torchao's names:
  tensorwise          one scale per tensor: the fastest kernel
  rowwise             one scale per row, powers of two: more accurate
  rowwise_with_gw_hp  rowwise, and the weight gradient's matmul in bf16: the most accurate
"""

from __future__ import annotations

import dataclasses

from torch import nn

from dflash_train.checks.compile_settings import compile_settings_kept
from dflash_train.checks.fp8 import fp8_shaped

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def convert_to_fp8(drafter: nn.Module, recipe: str, *, emulate: bool = False) -> int:
    """Swap the drafter's FP8-shaped linear layers for torchao's Float8Linear in place, before the
    optimizer is built and before torch.compile; returns how many were swapped. `emulate` runs the
    same casts and scales with bf16 matmuls (torchao's emulation: what CPU tests check)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    if recipe not in RECIPES:
        raise ValueError(f"draft.fp8: {recipe!r} is not one of off, {', '.join(RECIPES)}")
    # pad_inner_dim: the weight gradient's inner dimension is the batch's token count, which the
    # kernels need divisible by 16 and a ragged batch of contexts rarely is.
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True, emulate=emulate)
    with compile_settings_kept("torchao's float8 training conversion of the drafter (draft.fp8)"):
        convert_to_float8_training(drafter, config=config,
                                   module_filter_fn=lambda m, _fqn: isinstance(m, nn.Linear) and fp8_shaped(m))
    return sum(isinstance(m, Float8Linear) for m in drafter.modules())
