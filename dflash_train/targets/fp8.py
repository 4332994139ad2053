"""The frozen target's decoder in FP8 (`target.fp8`), through torchao's float8 inference quantisation.

Each decoder layer's linear weights are stored in float8_e4m3fn and every activation is cast to FP8
with a dynamic scale, so the target's matmuls run on the FP8 tensor cores. The embedding table and
the LM head stay in the target's dtype: the drafter reads both as plain tensors (block embeddings,
logits in the loss). The drafter is then trained on the FP8 target's features; serve it against the
target it will verify (docs/benchmarks/quality.md measures both pairings).

Tensorwise takes one scale for a whole activation tensor, so a token's features move with the other
tokens in its forward; rowwise scales each token alone (bfloat16 targets only, a torchao limit).
"""

from __future__ import annotations

from torch import nn

from dflash_train.checks.compile_settings import compile_settings_kept
from dflash_train.checks.fp8 import fp8_problem, fp8_shaped

GRANULARITIES = ("rowwise", "tensorwise")


def quantize_decoder(layers: nn.ModuleList, granularity: str) -> int:
    """Quantise the FP8-shaped linear layers of the target's decoder `layers` (on its GPU) in place;
    returns how many."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

    if granularity not in GRANULARITIES:
        raise ValueError(f"target.fp8: {granularity!r} is not one of off, {', '.join(GRANULARITIES)}")
    device = next(layers.parameters()).device
    problem = fp8_problem(device)
    if problem:
        raise ValueError(f"target.fp8: {problem}")
    chosen = sum(isinstance(m, nn.Linear) and fp8_shaped(m) for m in layers.modules())
    # set_inductor_config=False: torchao's default turns on coordinate-descent tuning for every graph
    # the process compiles later, the drafter's too (checks/compile_settings.py says what that cost).
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow() if granularity == "rowwise" else PerTensor(),
                                                       set_inductor_config=False)
    with compile_settings_kept("torchao's float8 quantisation of the target (target.fp8)"):
        quantize_(layers, config, filter_fn=lambda m, _fqn: isinstance(m, nn.Linear) and fp8_shaped(m))
    return chosen
