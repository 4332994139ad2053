"""`dflash-train eval`'s typed settings, read like every command's (config_loader.py): the flags are
derived from these fields (config_flags.py).

With `-c run.yaml` the run's own settings come first: its target (path, dtype), its `eval` prompts,
number of prompts and answer length, and its newest checkpoint as the drafter; flags override them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from dflash_train.config import ConfigError, RunConfig, TargetConfig
from dflash_train.config_loader import Override, Section, build, override_pairs


class DecodeSettings(Section):
    """How every prompt is decoded and timed."""

    max_new_tokens: int = Field(256, ge=1)
    """New tokens per answer."""
    temperature: float = Field(0.0, ge=0)
    """0 = greedy: the lossless check is exact."""
    block_size: int | None = Field(None, ge=2)
    """Tokens drafted per round (one verified + proposals); default: the drafter's."""
    seed: int = 0
    """Sampling seed (temperature > 0)."""
    batch_size: int = Field(64, ge=1)
    """Prompts decoded together for acceptance."""
    draft_p_min: float = Field(0.0, ge=0, le=1)
    """A DSpark drafter with a confidence head, or a DFlash2 drafter (its selector's softmax at the chosen
    candidate), ends each draft before its first slot whose confidence is below this, as llama.cpp's
    --spec-draft-p-min (docs/design.md#dspark); 0: off, every slot drafted."""
    acceptance_cache: Literal["auto", "ragged", "none"] = "auto"
    """How batched acceptance decoding runs the target: ragged = through one KV cache for rows of
    different lengths (a round costs the block alone); none = each round re-runs every row's whole
    sequence; auto = ragged where the target supports it (eager or SDPA attention; full or
    sliding-window layers), else none."""
    thinking: bool | None = None
    """The chat template's `enable_thinking` for the prompts: the mode the target is served in. With
    -c, default the run's (as its training data was rendered); else the template's default."""
    speed_prompts: int = Field(8, ge=0)
    """First turns decoded one at a time, with caches, for the speedup (0: no speed figures)."""
    speed_engine: Literal["auto", "static", "eager"] = "auto"
    """static: static KV caches, CUDA graphs on a GPU (as a server runs it; greedy, targets with
    full or sliding-window layers, else eager with the reason logged); eager: transformers' dynamic
    cache; auto = static on cuda, eager on cpu."""


class EvalJobConfig(Section):
    target: TargetConfig = Field(default_factory=TargetConfig)
    drafter: str
    """A training checkpoint dir or an export dir (with -c: default the run's newest checkpoint)."""
    prompts: list[str] = Field(default_factory=lambda: ["mt-bench"])
    """Prompt sets: mt-bench, humaneval, sharegpt, long (conversations to 4K-7K tokens) or a JSONL
    file, LABEL=SET to name one; the flag
    once per set. Several are evaluated one after another, the target and drafter loaded once."""
    num_prompts: int | None = Field(None, ge=1)
    """The first N prompts of each set; default: all."""
    out: str | None = None
    """Directory for eval.json and eval.png (several sets: one directory per set's label inside it,
    the label being LABEL, else the set's name or the file's stem); default: print only."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when a GPU is visible."""
    decode: DecodeSettings = Field(default_factory=DecodeSettings)

    @field_validator("target")
    @classmethod
    def _target_not_compiled(cls, value: TargetConfig) -> TargetConfig:
        if value.compile:
            raise ValueError("target.compile compiles training's target forward; eval decodes through its own "
                             "engines (decode.speed_engine): leave target.compile off here")
        return value

    @field_validator("prompts", mode="before")
    @classmethod
    def _one_or_more(cls, value):
        return [value] if isinstance(value, str) else value  # a run config's eval.prompts, one set

    @field_validator("prompts")
    @classmethod
    def _distinct_labels(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("no prompt set given")
        labels = [label for label, _ in prompt_sets(value)]
        if len(set(labels)) < len(labels):
            raise ValueError(f"two prompt sets share a label ({', '.join(labels)}): name them LABEL=SET")
        return value


def prompt_sets(prompts: list[str]) -> list[tuple[str, str]]:
    """(label, set) of each `prompts` entry: LABEL=SET, else the set's name or its file's stem. A
    prefix with a path separator, or an entry that is a file, is no label: `runs/lr=3e-4/held.jsonl`
    is a path (its label held)."""
    pairs = []
    for entry in prompts:
        label, sep, source = entry.partition("=")
        if sep and label and "/" not in label and not Path(entry).is_file():
            pairs.append((label, source))
        else:
            pairs.append((Path(entry).stem if "/" in entry or entry.endswith(".jsonl") else entry, entry))
    return pairs


def build_eval_config(run: RunConfig | None, overrides: Iterable[Override] | Mapping[str, Any] = (),
                      source: str = "<flags>") -> EvalJobConfig:
    """The run's settings (when there is a run config), then `overrides` (dotted key -> value: the flags)."""
    tree: dict = {}
    if run is not None:
        tree = {"target": {"path": run.target.path, "dtype": run.target.dtype},
                "num_prompts": run.eval.num_prompts, "decode": {"max_new_tokens": run.eval.max_new_tokens}}
        if run.eval.prompts:
            tree["prompts"] = run.eval.prompts
        from dflash_train.data.generation_mode import served_thinking

        if (thinking := served_thinking(run.data)) is not None:
            tree["decode"]["thinking"] = thinking
        from dflash_train.checkpoint.local import latest_checkpoint  # torch: only with a run config

        newest = latest_checkpoint(run.run_dir)
        if newest is not None:
            tree["drafter"] = str(newest)
    pairs = [(key, value) for key, value, _ in override_pairs(overrides)]
    keys = {key for key, _ in pairs}
    if "path" not in tree.get("target", {}) and "target.path" not in keys:
        raise ConfigError("eval needs --target (an HF model dir/id or smollm2), or -c with a run config")
    if "drafter" not in tree and "drafter" not in keys:
        raise ConfigError("eval needs --drafter (a checkpoint or export dir), or -c with a run that has a checkpoint")
    return build(EvalJobConfig, tree, pairs, source)
