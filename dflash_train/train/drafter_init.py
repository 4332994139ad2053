"""The drafter a run starts from: seeded fresh weights, or a warm start from `draft.init_from`.

Fresh weights come from the global RNG seeded with `seed` RIGHT before the drafter is built: loading
the target (its one-time GGUF conversion initialises a model too) draws from the same RNG, so seeding
any earlier would make the drafter depend on whether that conversion ran in this process.
A warm start takes the weights only: the optimizer and schedule start fresh, and `--resume` (which
loads its checkpoint afterwards) overrides it. `train` and `launch` both build drafters here.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from dflash_train.config import RunConfig
from dflash_train.draft.build import drafter_for
from dflash_train.families import family
from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig
from dflash_train.eval.export import check_state_dict, read_drafter_folder
from dflash_train.targets.model import Target
from dflash_train.train.shapes import draft_model_config

log = logging.getLogger("dflash_train")


def build_drafter(cfg: RunConfig, target: Target, device: torch.device) -> DFlashDraftModel:
    torch.manual_seed(cfg.seed)
    drafter = drafter_for(draft_model_config(cfg, target))
    if cfg.draft.init_layers_from is not None:
        copy_target_layers(drafter, target, cfg.draft.init_layers_from)
    if cfg.draft.init_from:
        warm_start(drafter, cfg.draft.init_from)
    return drafter.to(device)


def copy_target_layers(drafter: DFlashDraftModel, target: Target, layer_ids: list[int]) -> None:
    """Drafter layer i <- target decoder layer layer_ids[i], parameter by parameter (same names and
    shapes in Llama/Qwen-style layers). A parameter the target layer lacks (the drafter's q/k norms
    when the target has none) keeps its fresh value; one the drafter lacks is an error."""
    n = target.num_layers
    for i, (layer, tid) in enumerate(zip(drafter.layers, layer_ids, strict=True)):
        if not -n <= tid < n:
            raise ValueError(f"draft.init_layers_from: {tid} is not a layer of the target's {n}")
        source = dict(target.layers[tid].named_parameters())
        own = dict(layer.named_parameters())
        extra = sorted(set(source) - set(own))
        if extra:
            raise ValueError(f"draft.init_layers_from: target layer {tid} has parameters the drafter's layers "
                             f"lack ({', '.join(extra)}); this target's layers cannot be copied")
        for name, p in source.items():
            if p.shape != own[name].shape:
                raise ValueError(f"draft.init_layers_from: {name} is {tuple(p.shape)} in target layer {tid}, "
                                 f"{tuple(own[name].shape)} in drafter layer {i}")
            with torch.no_grad():
                own[name].copy_(p.detach().to(own[name].dtype))
    log.info("draft.init_layers_from: drafter layers start as copies of target layers %s", layer_ids)


def upgrades(saved: DraftModelConfig, current: DraftModelConfig) -> bool:
    """A drafter of a family the current one warm-starts from (a dflash one starting a dflash2 one):
    its weights are all there, the new family's own parts start so that it drafts as the one it holds."""
    return family(current.family).starts_from(saved.family)


def check_warm_start_compatible(saved: DraftModelConfig, current: DraftModelConfig, source: str) -> None:
    """Every field of the drafter's config must match, as for a resume: they fix its shapes (hidden
    size, vocabulary, layers) or its task (block size, captured target layers, mask token). A dflash
    drafter may start a dflash2 one (`upgrades`)."""
    skip = {"family", *family(current.family).size_fields} if upgrades(saved, current) else set()
    problems = [
        f"  {f.name}: {source} has {getattr(saved, f.name)!r}, config now has {getattr(current, f.name)!r}"
        for f in dataclasses.fields(current)
        if f.name not in skip and getattr(saved, f.name) != getattr(current, f.name)
    ]
    if problems:
        raise ValueError(f"draft.init_from: cannot warm-start from {source}, a drafter of a different setup:\n"
                         + "\n".join(problems))


def warm_start(drafter: DFlashDraftModel, path: str) -> None:
    """Load the weights of an exported drafter folder or a training checkpoint into `drafter`
    (an export's bf16 weights are cast to the drafter's dtype)."""
    saved, state = read_drafter_folder(path)
    check_warm_start_compatible(saved, drafter.config, path)
    check_state_dict(saved, state, path)
    if upgrades(saved, drafter.config):
        missing, unexpected = drafter.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
        drafter.reset_own_parts()  # e.g. identity convolutions, a zero codebook: it drafts as `path` did
        log.info("draft.init_from: the %s drafter starts as the %s drafter %s (%d new tensors)",
                 drafter.config.family, saved.family, path, len(missing))
        return
    drafter.load_state_dict(state, strict=True)
    log.info("draft.init_from: warm-started the drafter from %s", path)
