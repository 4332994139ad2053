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
from dflash_train.config_model import DraftConfig, ObjectiveConfig, TargetConfig
from dflash_train.families import family, term_owner
from dflash_train.config_training import CheckpointConfig, DataConfig, EvalConfig, TrackingConfig, TrainConfig

__all__ = ["ConfigError", "RunConfig", "build_config", "dump_config", "load_config", "parse_override"]


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

    @model_validator(mode="before")
    @classmethod
    def _slot_weights_where_unset(cls, tree: Any) -> Any:
        """objective.slot_weights left unset: the decay where the run asks for it (another gamma) or
        cannot weigh by D-PACE (a logit-bias family, a fused CE kernel); else D-PACE, the default."""
        if not isinstance(tree, dict):
            return tree
        objective, draft, train = (tree.get(name) or {} for name in ("objective", "draft", "train"))
        if not all(isinstance(section, dict) for section in (objective, draft, train)) or "slot_weights" in objective:
            return tree  # a section of the wrong type: its own validation names it
        default_gamma = ObjectiveConfig.model_fields["gamma"].default
        try:
            logit_bias = family(draft.get("family", "dflash")).logit_bias
            gamma = float(objective.get("gamma", default_gamma))
        except (KeyError, TypeError, ValueError):
            return tree  # an unknown family or a gamma that is no number: their own validation names them
        if logit_bias or train.get("ce_kernel", "chunked") != "chunked" or gamma != default_gamma:
            tree = {**tree, "objective": {**objective, "slot_weights": "decay"}}
        return tree

    @model_validator(mode="after")
    def _cuda_graphs_fit_the_run(self) -> RunConfig:
        if not self.train.cuda_graphs:
            return self
        if self.device == "cpu":
            raise ValueError("train.cuda_graphs runs on CUDA only: set device to cuda or train.cuda_graphs=false")
        if not self.data.buckets:
            raise ValueError("train.cuda_graphs captures one graph per static batch shape: set data.length_bucket (e.g. 256) "
                             "or data.length_buckets")
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
    def _window_holds_a_block(self) -> RunConfig:
        window, block = self.draft.sliding_window, self.objective.block_size
        if window is not None and window < block:
            raise ValueError(f"draft.sliding_window={window} is shorter than objective.block_size={block}: "
                             "a block's last slots would see no context; use a window of at least a block")
        return self

    @model_validator(mode="after")
    def _loss_fits_the_family(self) -> RunConfig:
        spec = family(self.draft.family)
        for term, weight in self.objective.loss.items():
            owner = term_owner(term)
            if weight > 0 and owner not in (None, spec):
                raise ValueError(f"objective.loss.{term} trains draft.family={owner.name}: set draft.family={owner.name}")
        for term in spec.loss_terms:
            if not self.objective.loss.get(term, 0.0) > 0:
                raise ValueError(f"draft.family={spec.name} without objective.loss.{term} leaves its {term} "
                                 f"untrained: add {term} to objective.loss, e.g. {{ce: 1, {term}: 1}}")
        if spec.check_config:
            spec.check_config(self)
        if spec.logit_bias and self.train.ce_kernel != "chunked":
            raise ValueError(f"train.ce_kernel={self.train.ce_kernel} with draft.family={spec.name}: only the chunked "
                             "kernel adds its logit bias; use train.ce_kernel=chunked")
        if self.objective.slot_weights == "dpace" and spec.logit_bias:
            raise ValueError(f"objective.slot_weights=dpace with draft.family={spec.name}: its logit bias cannot "
                             "take weights formed after the loss's chunks ran; set objective.slot_weights=decay")
        if self.draft.fp8 != "off" and not spec.fp8_drafter:
            raise ValueError(f"draft.fp8 with draft.family={spec.name}: its layers in FP8 are not tested yet; "
                             "set draft.fp8=off")
        selector = self.objective.loss.get("selector", 0.0) > 0
        # changed from their defaults (a saved run config repeats the defaults of every key; join was
        # selector_outside_top_k's until 2026-12-07, so runs saved before then say join)
        unread = [k for k, saved_defaults in (("selector_outside_top_k", ("skip", "join")), ("selector_weights", ("slot",)))
                  if getattr(self.objective, k) not in saved_defaults and not selector]
        if unread:
            raise ValueError(f"objective.{unread[0]} is read with objective.loss.selector only (draft.family=dflash2)")
        if selector and self.train.fp8_lm_head:
            raise ValueError("objective.loss.selector reads rows of the bf16/fp32 LM head: set train.fp8_lm_head=false")
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
