"""Settings of `dflash-train generate`: YAML file + flat CLI flags or dotted overrides.

Sampling settings are recorded in the output's meta.json and must match on resume: one output
directory never mixes answers produced under different settings. Server URLs, concurrency and
timeouts are how the work is done, not what it produces, so they may change between restarts.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflash_train.config import ConfigError, format_validation_errors, set_dotted, read_yaml_tree


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SamplingConfig(_Section):
    """What the target is asked to do; recorded in meta.json."""

    temperature: float = Field(0.0, ge=0)
    """0 = greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(2048, ge=1)
    """Most new tokens per assistant turn; longer answers are cut and counted as truncated."""
    thinking: bool | None = None
    """Chat-template kwarg `enable_thinking`; None leaves the template's default."""
    system_prompt: str | None = None
    """Prepended to conversations that have no system message of their own."""
    seed: int | None = 0
    """Each request gets its own seed derived from this, the row and the turn (reproducible, not shared)."""


class HttpConfig(_Section):
    """OpenAI-compatible chat-completions servers (SGLang, vLLM)."""

    server_urls: list[str] = Field(default_factory=list)
    """Base URLs (with or without /v1); requests go to the least busy one."""
    api_key: str | None = None
    request_timeout: float = Field(600.0, gt=0)
    """Seconds for one whole request; long generations need minutes."""
    max_retries: int = Field(6, ge=0)
    """Retries on connection errors, timeouts, 429 and 5xx; then the row is an error."""
    backoff_s: float = Field(0.5, ge=0)
    """First retry waits up to this (full jitter), doubling per attempt."""
    backoff_max_s: float = Field(30.0, ge=0)


class LocalConfig(_Section):
    """In-process transformers generation (small targets, quickstart)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    batch_size: int = Field(16, ge=1)
    engine: Literal["padded", "static", "continuous", "graphed"] = "padded"
    """padded: one left-padded `generate` per batch (every row runs until the longest ends);
    static: the same with a preallocated KV cache, decode steps compiled into CUDA graphs on a GPU;
    continuous: transformers' continuous batching (paged KV cache, finished rows replaced at once; it sizes
    the cache from free memory: 14 GB resident on a CPU for two ~300-token prompts);
    graphed: ours (generate/graphed_engine.py): `batch_size` rows on a static per-row cache, finished rows
    refilled, the decode step one CUDA graph on a GPU; greedy or temperature sampling, no top-p. The
    fastest on a GPU (docs/benchmarks/generate_local.md)."""
    compile_step: bool = False
    """graphed engine: the decode step through torch.compile (fused kernels) before its CUDA graph is
    captured. 1.9x for a one-row SmolLM2 step (docs/benchmarks/speed.md); at a thousand rows, where
    reading the KV cache dominates, not measured yet, and every cache growth compiles again (~30 s)."""


class GenerateConfig(_Section):
    inputs: list[str] = Field(min_length=1)
    """JSONL or Parquet conversations or prompts (OpenAI `messages` or ShareGPT `conversations`)."""
    output_dir: str
    output_format: Literal["parquet", "jsonl"] = "parquet"
    backend: Literal["http", "local"] = "http"
    model: str | None = None
    """http: model name sent to the servers (default: the one they serve); local: target path."""
    concurrency: int = Field(64, ge=1)
    """Conversations in flight; for the local backend it should be >= batch_size."""
    shard_size: int = Field(1000, ge=1)
    """Rows per committed shard: at most this much work is redone after a crash..."""
    shard_interval_s: float = Field(60.0, gt=0)
    """...or at most this many seconds of it, whichever comes first: finished rows are committed at
    least this often from the run's start, also while no row finishes, so a job killed every few
    minutes still progresses (`--commit-interval`)."""
    skip_invalid: bool = False
    """Record malformed input rows as `skipped` with the reason instead of stopping at the first."""
    limit: int | None = Field(None, ge=1)
    """Only the first N input rows (quick runs)."""
    progress: bool = True
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    local: LocalConfig = Field(default_factory=LocalConfig)

    @model_validator(mode="after")
    def _backend_is_usable(self) -> GenerateConfig:
        if self.backend == "http" and not self.http.server_urls:
            raise ValueError("backend 'http' needs at least one server URL (http.server_urls / --server-url)")
        if self.backend == "local" and self.local.engine == "graphed" and self.sampling.top_p < 1:
            raise ValueError(f"local.engine 'graphed' samples from the whole distribution: sampling.top_p "
                             f"{self.sampling.top_p} needs engine padded, static or continuous")
        if self.local.compile_step and (self.backend != "local" or self.local.engine != "graphed"):
            raise ValueError(f"local.compile_step compiles the graphed engine's step: it needs backend 'local' "
                             f"and local.engine 'graphed' (got {self.backend}, {self.local.engine})")
        resolved = [str(Path(p).resolve()) for p in self.inputs]
        if len(set(resolved)) != len(resolved):
            raise ValueError(f"inputs lists a file twice: {self.inputs}")
        return self


# Flat CLI flag -> dotted config key. Dotted keys are accepted as they are.
FLAG_KEYS = {
    "input": "inputs",
    "inputs": "inputs",
    "output": "output_dir",
    "output_dir": "output_dir",
    "output_format": "output_format",
    "backend": "backend",
    "model": "model",
    "concurrency": "concurrency",
    "shard_size": "shard_size",
    "commit_interval": "shard_interval_s",
    "skip_invalid": "skip_invalid",
    "limit": "limit",
    "progress": "progress",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "max_tokens": "sampling.max_tokens",
    "thinking": "sampling.thinking",
    "system_prompt": "sampling.system_prompt",
    "seed": "sampling.seed",
    "server_url": "http.server_urls",
    "server_urls": "http.server_urls",
    "api_key": "http.api_key",
    "request_timeout": "http.request_timeout",
    "max_retries": "http.max_retries",
    "device": "local.device",
    "dtype": "local.dtype",
    "batch_size": "local.batch_size",
    "engine": "local.engine",
    "compile_step": "local.compile_step",
}
_LIST_KEYS = {"inputs", "http.server_urls"}


def build_generate_config(
    tree: Mapping | None = None,
    overrides: Mapping[str, Any] | Namespace | None = None,
    source: str = "<dict>",
) -> GenerateConfig:
    """Config tree + overrides; None values mean "flag not given".

    A dict may use flag names (`server_url`) or dotted keys (`sampling.top_p`); unknown keys are
    errors. From an argparse namespace only the flag names above are taken: the CLI's own
    attributes (config path, subcommand) are not settings.
    """
    tree = dict(tree or {})
    if isinstance(overrides, Namespace):
        items = {k: v for k, v in vars(overrides).items() if k in FLAG_KEYS}
    else:
        items = dict(overrides or {})
    for name, value in items.items():
        if value is None:
            continue
        key = FLAG_KEYS.get(name.replace("-", "_"), name)
        if key in _LIST_KEYS and not isinstance(value, (list, tuple)):
            value = [value]
        set_dotted(tree, key, list(value) if isinstance(value, tuple) else value, f"override '{name}'")
    try:
        return GenerateConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_errors(err, source)) from None


def load_generate_config(
    path: str | Path | None = None, overrides: Mapping[str, Any] | Namespace | None = None
) -> GenerateConfig:
    tree, source = read_yaml_tree(path, "<flags>")
    return build_generate_config(tree, overrides, source)
