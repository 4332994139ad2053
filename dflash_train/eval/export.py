"""Drafter folders in and out: training checkpoints, and the export SGLang, vLLM and z-lab load.

Training checkpoint dir: `model.safetensors` (DFlashDraftModel state dict) + `draft_config.json`
(DraftModelConfig.to_dict()). Export dir (docs/design.md#export-format): `config.json` = a Qwen3 config plus
`architectures: ["DFlashDraftModel"]`, `auto_map`, `block_size`, `num_target_layers` and
`dflash_config: {mask_token_id, target_layer_ids}`; `model.safetensors` in bf16 with the drafter's
own tensors only (embeddings and LM head are the target's and never stored); `dflash.py`, the
drafter as transformers' trust_remote_code loads it (hf_modeling_dflash.py).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from dflash_train.atomic import new_temp_dir, read_json, swap_dir
from dflash_train.checks.manifest import MANIFEST_NAME
from dflash_train.checkpoint.integrity import require_intact
from dflash_train.checkpoint.local import latest_checkpoint, read_checkpoint_file
from dflash_train.disk import require_writable, writes_to
from dflash_train.draft.build import drafter_for
from dflash_train.draft.model import DFlashDraftModel, DraftModelConfig
from dflash_train.families import by_architecture, family

if TYPE_CHECKING:  # an annotation only: `export` loads no target, and transformers' model code took
    from dflash_train.targets.model import Target  # ~3.5 s of its start

log = logging.getLogger("dflash_train")

CHECKPOINT_CONFIG = "draft_config.json"
WEIGHTS = "model.safetensors"
MODELING_FILE = Path(__file__).with_name("hf_modeling_dflash.py")
"""Copied into every export as MODELING_MODULE.py: the drafter for transformers' trust_remote_code."""
MODELING_MODULE = "dflash"
"""z-lab's name: their drafters' auto_map reads "dflash.DFlashDraftModel"."""


def export_config(cfg: DraftModelConfig, mask_token: str | None = None) -> dict:
    """config.json of an export: Qwen3 fields + the DFlash ones (layout as z-lab's published drafters).

    SGLang resolves the mask by `dflash_config.mask_token` (a string; default "<|MASK|>", which it
    adds to the tokenizer) and only newer versions read `mask_token_id`: pass the token's text when
    the mask id is a real tokenizer token.
    """
    dflash = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)}
    if mask_token is not None:
        dflash["mask_token"] = mask_token
    spec = family(cfg.family)
    if spec.size_fields:  # the keys llama.cpp's converter and vLLM's loader of such a family read
        dflash.update({"block_size": cfg.block_size, **{k: getattr(cfg, k) for k in spec.size_fields}})
    return {
        "architectures": [spec.architecture],
        # AutoModel.from_pretrained(export, trust_remote_code=True) builds the drafter from the copied file
        **({"auto_map": {"AutoModel": f"{MODELING_MODULE}.{spec.architecture}"}} if spec.remote_code else {}),
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_hidden_layers,
        "layer_types": list(cfg.layer_types),
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        # llama.cpp's converter reads these three: a window on the layers layer_types calls sliding
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        "max_window_layers": cfg.num_hidden_layers,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "bfloat16",
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        # vLLM reads this first when present (older versions only this, else 3 default layers): the
        # target's layer *inputs* it captures, so our layer outputs shifted by one
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "dflash_config": dflash,
        **dict(spec.export_keys),
    }


def draft_config_from_export(path: str | Path) -> DraftModelConfig:
    """The DraftModelConfig of an export folder (reads config.json only)."""
    c = json.loads((Path(path) / "config.json").read_text())
    if "dflash_config" not in c:
        raise ValueError(f"{path}/config.json has no dflash_config: not a DFlash drafter export")
    rope_theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
    spec = by_architecture((c.get("architectures") or [None])[0], f"{path}/config.json")
    extra = {"family": spec.name, **{k: int(c["dflash_config"].get(k, 0)) for k in spec.size_fields}}
    return DraftModelConfig(
        hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"],
        vocab_size=c["vocab_size"],
        block_size=c["block_size"],
        target_layer_ids=list(c["dflash_config"]["target_layer_ids"]),
        num_target_layers=c["num_target_layers"],
        mask_token_id=c["dflash_config"]["mask_token_id"],
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=rope_theta,
        max_position_embeddings=c["max_position_embeddings"],
        layer_types=list(c.get("layer_types") or []),
        sliding_window=c.get("sliding_window") if c.get("use_sliding_window") else None,
        **extra,
    )


def _existing_mask_token(folder: str | Path) -> str | None:
    """An export's own `dflash_config.mask_token`, kept when it is exported again."""
    config = read_json(Path(folder) / "config.json") or {}
    return (config.get("dflash_config") or {}).get("mask_token")


def drafter_folder(path: str | Path) -> Path:
    """`path`, or for a run directory its newest checkpoint: `export runs/a out/a` as the README writes it."""
    path = Path(path)
    if not (path / WEIGHTS).is_file() and (path / "checkpoints").is_dir():
        newest = latest_checkpoint(path)
        if newest is None:
            raise FileNotFoundError(f"{path}: a run directory without a checkpoint")
        log.info("%s: its newest checkpoint, %s", path, newest.name)
        return newest
    return path


def read_drafter_config(path: str | Path) -> DraftModelConfig:
    """The DraftModelConfig of a training checkpoint dir (or its run dir: the newest) or an export
    dir, its weights left unread."""
    path = drafter_folder(path)
    if not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"{path}: no {WEIGHTS} (expected a drafter checkpoint or export folder)")
    if (path / CHECKPOINT_CONFIG).is_file():
        return DraftModelConfig(**json.loads((path / CHECKPOINT_CONFIG).read_text()))
    if (path / "config.json").is_file():
        return draft_config_from_export(path)
    raise FileNotFoundError(f"{path}: neither {CHECKPOINT_CONFIG} (checkpoint) nor config.json (export)")


def read_drafter_folder(path: str | Path) -> tuple[DraftModelConfig, dict[str, torch.Tensor]]:
    """(config, state dict) of a training checkpoint dir (or its run dir: the newest) or an export dir."""
    path = drafter_folder(path)
    if (path / CHECKPOINT_CONFIG).is_file() and (path / WEIGHTS).is_file():
        require_intact(path, [WEIGHTS, CHECKPOINT_CONFIG])  # only the files read here are hashed
    cfg = read_drafter_config(path)
    # SGLang accepts a `model.` prefix on every name; so do we.
    state = {name.removeprefix("model."): t for name, t in read_checkpoint_file(path / WEIGHTS, load_file).items()}
    return cfg, state


def check_state_dict(cfg: DraftModelConfig, state: dict[str, torch.Tensor], source: str) -> None:
    """Names and shapes exactly as a DFlashDraftModel of `cfg`: SGLang's and vLLM's loaders skip a
    weight they have no parameter for without a word, so an extra name would be silently dropped."""
    with torch.device("meta"):
        expected = {name: t.shape for name, t in drafter_for(cfg).state_dict().items()}
    if set(state) != set(expected):
        raise ValueError(
            f"{source}: tensor names differ from a {family(cfg.family).architecture}'s: "
            f"missing {sorted(set(expected) - set(state))}, unexpected {sorted(set(state) - set(expected))}"
        )
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise ValueError(f"{source}: {name} has shape {list(state[name].shape)}, config implies {list(shape)}")


def check_drafter_fits(cfg: DraftModelConfig, target: Target) -> None:
    """A ValueError naming both sides when the drafter was built for another target."""
    pairs = [
        ("hidden_size", cfg.hidden_size, target.hidden_size),
        ("num_target_layers", cfg.num_target_layers, target.num_layers),
        ("vocab_size", cfg.vocab_size, target.vocab_size),
    ]
    for name, drafter_value, target_value in pairs:
        if drafter_value != target_value:
            raise ValueError(
                f"drafter does not fit target {target.name}: drafter {name}={drafter_value}, "
                f"target {name}={target_value}"
            )
    target.check_layer_ids(cfg.target_layer_ids)


def load_drafter(path: str | Path, target: Target, device: torch.device | str | None = None) -> DFlashDraftModel:
    """A drafter from a training checkpoint or an export folder, checked against `target`,
    in the target's dtype on `device` (default: the target's), in eval mode."""
    cfg, state = read_drafter_folder(path)
    check_drafter_fits(cfg, target)
    check_state_dict(cfg, state, str(path))
    with torch.device("meta"):  # no random init of weights that are overwritten at once
        model = drafter_for(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    dtype = target.embed_weight.dtype
    return model.to(device=device or target.device, dtype=dtype).eval().requires_grad_(False)


def run_target(checkpoint_dir: str | Path) -> str | None:
    """The target a training checkpoint's run trained on (runs/<name>/checkpoints/step_N -> its
    manifest), or None for a folder outside a run."""
    manifest = read_json(Path(checkpoint_dir).resolve().parents[1] / MANIFEST_NAME)
    return ((manifest or {}).get("config") or {}).get("target", {}).get("path")


def mask_token_text(target: str, mask_token_id: int) -> str | None:
    """The text of the mask token in the target's tokenizer (None: the id is past the tokenizer's
    tokens, an embedding row no text names)."""
    from dflash_train.targets.tokenizer import load_tokenizer, resolve_target_path

    tokenizer = load_tokenizer(resolve_target_path(target))
    return tokenizer.convert_ids_to_tokens(mask_token_id) if mask_token_id < len(tokenizer) else None


def warn_unservable(cfg: DraftModelConfig, source: str) -> None:
    last = cfg.num_target_layers - 1
    if last in cfg.target_layer_ids:
        log.warning("%s: target_layer_ids %s include the target's last layer (%d): SGLang captures the inputs of "
                    "layers only, so it never serves this drafter, and llama.cpp reads a layer that does not exist",
                    source, cfg.target_layer_ids, last)


def export_drafter(checkpoint_dir: str | Path, out_dir: str | Path, mask_token: str | None = None,
                   target: str | None = None) -> Path:
    """Training checkpoint (or another export) -> export folder with bf16 weights.

    `mask_token`: the text of the mask token, for servers that look it up by name (see export_config);
    default: looked up in `target`'s tokenizer (default: the target of the checkpoint's run).
    """
    out_dir = Path(out_dir)
    require_writable(out_dir.parent, f"the export {out_dir}")  # written beside it, then renamed
    checkpoint_dir = drafter_folder(checkpoint_dir)
    cfg, state = read_drafter_folder(checkpoint_dir)
    check_state_dict(cfg, state, str(checkpoint_dir))
    warn_unservable(cfg, str(checkpoint_dir))
    if mask_token is None:
        mask_token = _existing_mask_token(checkpoint_dir)
    target = target or run_target(checkpoint_dir)
    if mask_token is None and target is not None:
        mask_token = mask_token_text(target, cfg.mask_token_id)
    if mask_token is None:
        log.warning("%s: no mask token text for id %d (no target known: pass --target): SGLang versions that "
                    "look the mask up by name add <|MASK|> to the tokenizer instead", out_dir, cfg.mask_token_id)
    weights = {name: t.to(torch.bfloat16).contiguous() for name, t in state.items()}

    with writes_to(out_dir):
        tmp = new_temp_dir(out_dir)
        try:
            (tmp / "config.json").write_text(json.dumps(export_config(cfg, mask_token), indent=2) + "\n")
            save_file(weights, tmp / WEIGHTS, metadata={"format": "pt"})
            shutil.copyfile(MODELING_FILE, tmp / f"{MODELING_MODULE}.py")
            return swap_dir(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
