"""Settings of `dflash-train generate`, read like every command's (config_loader.py): a YAML file,
then dotted overrides and the flags derived from these fields (config_flags.py).

Sampling settings are recorded in the output's meta.json and must match on resume: one output
directory never mixes answers produced under different settings. Server URLs, concurrency and
timeouts are how the work is done, not what it produces, so they may change between restarts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from dflash_train.config_loader import Override, Section, build, read_yaml_tree


class SamplingConfig(Section):
    """What the target is asked to do; recorded in meta.json."""

    temperature: float = Field(0.0, ge=0)
    """0 = greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: sample from the smallest set of tokens holding this much probability."""
    max_tokens: int = Field(2048, ge=1)
    """Most new tokens per assistant turn; longer answers are cut and counted as truncated."""
    thinking: bool | None = None
    """Chat-template kwarg `enable_thinking`; None leaves the template's default."""
    system_prompt: str | None = None
    """Prepended to conversations that have no system message of their own."""
    seed: int | None = 0
    """Each request gets its own seed derived from this, the row and the turn (reproducible, not shared)."""


class HttpConfig(Section):
    """OpenAI-compatible chat-completions servers (SGLang, vLLM)."""

    server_urls: list[str] = Field(default_factory=list, json_schema_extra={"flag": "--server-url"})
    """Base URLs (with or without /v1), one per --server-url; requests go to the least busy one."""
    api_key: str | None = None
    """Bearer token sent to the servers; default: none."""
    request_timeout: float = Field(600.0, gt=0)
    """Seconds for one whole request; long generations need minutes."""
    max_retries: int = Field(6, ge=0)
    """Retries on connection errors, timeouts, 429 and 5xx; then the row is an error."""
    backoff_s: float = Field(0.5, ge=0)
    """First retry waits up to this (full jitter), doubling per attempt."""
    backoff_max_s: float = Field(30.0, ge=0)
    """Longest wait between two retries."""


class LocalConfig(Section):
    """In-process transformers generation (small targets, quickstart)."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when a GPU is visible."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto = bf16 on GPU, fp32 on CPU."""
    batch_size: int = Field(16, ge=1)
    """Prompts per generate call (rows decoded together)."""
    engine: Literal["padded", "static", "continuous", "graphed"] = "padded"
    """padded: one left-padded `generate` per batch; static: the same on a preallocated KV cache, CUDA
    graphs on a GPU; continuous: transformers' continuous batching (sizes its cache from free memory);
    graphed: ours (decode/graphed_engine.py), finished rows refilled, the decode step one CUDA graph,
    no top-p: the fastest on a GPU (history: docs/benchmarks/generate_local.md)."""
    compile_step: bool = False
    """graphed engine: torch.compile the decode step before capturing it; each cache growth compiles
    again (~30 s) (history: docs/benchmarks/speed.md)."""
    prefill: Literal["auto", "packed", "padded"] = "auto"
    """graphed engine: how admitted prompts are prefilled. packed: one row of tokens per admission,
    varlen flash attention (plain causal models whose heads flash attention takes); padded: grouped
    by width, left-padded; auto: packed where the model allows it (history:
    docs/benchmarks/generate_local.md)."""


class GenerateConfig(Section):
    inputs: list[str] = Field(min_length=1, json_schema_extra={"flag": "--input"})
    """JSONL or Parquet conversations or prompts (OpenAI `messages` or ShareGPT `conversations`), one
    per --input."""
    output_dir: str = Field(json_schema_extra={"flag": "--out", "older_flags": ["--output"]})
    """Output directory (shards, meta.json, summary.json); rerun the same command to resume."""
    output_format: Literal["parquet", "jsonl"] = "parquet"
    """Shard file format."""
    backend: Literal["http", "local"] = "http"
    """http: OpenAI-compatible servers (`http` section); local: in process (`local` section)."""
    model: str | None = None
    """http: model name sent to the servers (default: the one they serve); local: target path."""
    concurrency: int = Field(64, ge=1)
    """Conversations in flight; for the local backend it should be >= batch_size."""
    shard_size: int = Field(1000, ge=1)
    """Rows per committed shard: at most this much work is redone after a crash..."""
    shard_interval_s: float = Field(60.0, gt=0, json_schema_extra={"flag": "--commit-interval"})
    """...or at most this many seconds of it: finished rows are committed at least this often, so a
    job killed every few minutes still progresses."""
    skip_invalid: bool = False
    """Record malformed input rows as `skipped` with the reason instead of stopping at the first."""
    limit: int | None = Field(None, ge=1)
    """Only the first N input rows (quick runs); default: all."""
    progress: bool = True
    """Show a progress bar."""
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
        if self.local.prefill != "auto" and (self.backend != "local" or self.local.engine != "graphed"):
            raise ValueError(f"local.prefill chooses the graphed engine's prefills: it needs backend 'local' "
                             f"and local.engine 'graphed' (got {self.backend}, {self.local.engine})")
        resolved = [str(Path(p).resolve()) for p in self.inputs]
        if len(set(resolved)) != len(resolved):
            raise ValueError(f"inputs lists a file twice: {self.inputs}")
        return self


def build_generate_config(tree: Mapping | None = None, overrides: Iterable[Override] | Mapping[str, Any] = (),
                          source: str = "<dict>") -> GenerateConfig:
    """`tree` (as in the YAML file) with `overrides` (dotted key -> value, or `key=value` text) applied."""
    return build(GenerateConfig, tree, overrides, source)


def load_generate_config(path: str | Path | None = None,
                         overrides: Iterable[Override] | Mapping[str, Any] = ()) -> GenerateConfig:
    tree, source = read_yaml_tree(path, "<flags>")
    return build(GenerateConfig, tree, overrides, source)
