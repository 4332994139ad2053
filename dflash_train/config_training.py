"""The run config's sections for how it trains: data, schedule, checkpoints, tracking, evaluation.

Each field's docstring is the help of its command-line flag (config_flags.py); `config.py` composes
the sections into one `RunConfig` and holds the rules that span sections.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from dflash_train.config_loader import Section


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
    length_buckets: list[int] = Field(default_factory=list)
    """Pad each batch's length up to the first of these that holds it, instead of length_bucket's
    multiples: ascending, the last at least max_length (e.g. [256, 512, 768, 1024, 1536, 2048, 3072,
    4096, 6144, 8192]). Rows of many lengths then need few shapes without short rows padded to a long
    multiple (results/smollm2-h100/long-8k-2.5min: 488-token rows in 2,048-token multiples, 0.12x the tokens/s)."""

    @model_validator(mode="after")
    def _one_bucket_rule(self) -> DataConfig:
        if not self.length_buckets:
            return self
        if self.length_bucket:
            raise ValueError("data.length_bucket and data.length_buckets are two ways to pad: set one")
        b = self.length_buckets
        if b[0] < 1 or any(x >= y for x, y in zip(b, b[1:])) or b[-1] < self.max_length:
            raise ValueError(f"data.length_buckets {b}: positive and ascending, the last at least data.max_length "
                             f"({self.max_length})")
        return self

    @property
    def buckets(self) -> int | tuple[int, ...]:
        """What batching pads to (data/batching.py `padded_length`): the listed lengths up to the first
        that holds max_length (no row is longer: those past it would be compiled for nothing), else
        length_bucket's multiple (0: no bucket shapes)."""
        if not self.length_buckets:
            return self.length_bucket
        past = next(i for i, n in enumerate(self.length_buckets) if n >= self.max_length)
        return tuple(self.length_buckets[: past + 1])

    @property
    def bucket_lengths(self) -> tuple[int, ...]:
        """Every padded length a batch can take (empty without buckets)."""
        if self.length_buckets or not self.length_bucket:
            return self.buckets or ()
        return tuple(range(self.length_bucket, self.max_length + self.length_bucket, self.length_bucket))

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
    activation_checkpointing: bool = False
    """Recompute each draft layer in the backward instead of keeping its activations: the drafter's
    memory then grows with its layers' inputs only, for many anchors or long sequences (a step's block
    tokens are anchors x block size); the layers' forward runs twice."""
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
    """Prompt set of that eval: mt-bench, humaneval, sharegpt, long or a JSONL file."""
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
