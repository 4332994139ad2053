"""The frozen target: loading, selective hidden-state capture, and its identity.

Only the configured layers are captured, with forward hooks on those decoder layers (never
`output_hidden_states`, which keeps every layer alive), and the forward stops right after the
deepest captured layer: later layers and the LM head are never run during training.
Layer id i = OUTPUT of decoder layer i (HF `hidden_states[i + 1]`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dflash_train.checks import compile_cache
from dflash_train.config_model import TargetConfig
from dflash_train.data.chat import text_format
from dflash_train.checks.fp8 import fp8_problem
from dflash_train.targets.fp8 import quantize_decoder
from dflash_train.targets.path import load_pretrained
from dflash_train.compiled_steps import raising_past_recompile_limit
from dflash_train.targets.tokenizer import load_tokenizer, resolve_target_path, tokenizer_fingerprint
from dflash_train.targets.tensor_parallel import shard_decoder

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


def input_embedding_table(embedding: nn.Embedding) -> torch.Tensor:
    """The rows the target's forward feeds its first layer: the embedding table, times the
    embedding's scale where the family has one (Gemma: sqrt(hidden), which SGLang and vLLM apply to
    the drafter's block tokens too). A scaled family costs one copy of the table."""
    scale = getattr(embedding, "embed_scale", None)
    if scale is None:
        return embedding.weight
    return embedding.weight * scale.to(embedding.weight.dtype)  # as the embedding's forward rounds it


class _StopForward(Exception):
    pass


@dataclass
class Target:
    model: nn.Module
    tokenizer: object
    name: str
    device: torch.device
    fp8: str = "off"
    """`target.fp8` as loaded: its features are not the bf16 target's, so captures and manifests say so."""
    compiled: bool = False
    """Its decoder layers' forwards compiled (`target.compile`, `compile_decoder`): here, or where they
    run in other processes (`decoder` False)."""

    def __post_init__(self):
        self.layers = decoder_layers(self.model)
        # False on a split launch's drafter ranks (load_target(decoder=False)): only the embedding and
        # LM head are here, the layers run on the target ranks
        self.decoder = not all(isinstance(layer, nn.Identity) for layer in self.layers)
        self.num_layers = len(self.layers)
        self.hidden_size = self.model.config.hidden_size
        self.embed_weight = input_embedding_table(self.model.get_input_embeddings())
        self.lm_head_weight = self.model.get_output_embeddings().weight
        self.vocab_size = self.embed_weight.shape[0]

    @property
    def compiled_here(self) -> bool:
        """Compiled layers in this process: what a warm-up has to run."""
        return self.compiled and self.decoder

    @property
    def description(self) -> dict:
        """What a run's manifest records of the target: its class, attention, text format."""
        return {"class": type(self.model).__name__, "attn_implementation": self.model.config._attn_implementation,
                "text_format": text_format(self.tokenizer), "fp8": self.fp8, "compiled": self.compiled}

    @property
    def identity(self) -> dict:
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "tokenizer": tokenizer_fingerprint(self.tokenizer),
        } | ({"fp8": self.fp8} if self.fp8 != "off" else {})

    def check_layer_ids(self, layer_ids: list[int]) -> None:
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {layer_ids}: {bad} not in 0..{self.num_layers - 1} "
                f"({self.name} has {self.num_layers} layers)"
            )

    @contextlib.contextmanager
    def eager(self):
        """Within the block the decoder layers run uncompiled (`target.compile`): evaluation decodes
        with KV caches, autocast and shapes training never shows them, each a new graph otherwise."""
        compiled = {i: vars(layer).pop("forward") for i, layer in enumerate(self.layers) if "forward" in vars(layer)}
        try:
            yield
        finally:
            for i, forward in compiled.items():
                self.layers[i].forward = forward

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


def compile_decoder(target: Target) -> None:
    """`target.compile`: each decoder layer's forward through torch.compile, in place, once. The
    forward, not the module's call: the capture hooks (`Target.capture`, added per call) stay outside
    the graph, so hooked and unhooked layers share it and a new hook recompiles nothing. dynamic=None:
    the first shape compiles static, later ones symbolic in what changed; the warm-up
    (`warm_up_compiled`) leaves a graph for any rows and length and one for a single row (dynamo
    specialises sizes of 1). Past the recompile limit dynamo would quietly run the layers eagerly:
    here it raises instead. A target without decoder layers here (a drafter-only rank's) has nothing
    to compile; it is marked compiled all the same, so that the manifest its rank writes says how the
    target ranks run the layers."""
    if target.compiled:
        return
    target.compiled = True
    if not target.decoder:
        return
    compile_cache.activate(compile_cache.cache_key())  # the trainer's keyed, durable cache, never /tmp
    for layer in target.layers:
        if "forward" not in vars(layer):  # another Target over the same model compiled it already
            layer.forward = _compiled(layer.forward)


def _compiled(forward):
    fn = torch.compile(forward, dynamic=None)

    def run(*args, **kwargs):
        with raising_past_recompile_limit():
            return fn(*args, **kwargs)

    return run


def warm_up_compiled(target: Target, shapes: list[tuple[int, int]], layer_ids: list[int]) -> None:
    """A compiled target's graphs for every shape a run may send it: random tokens of the run's own
    `shapes` (rows, length; lengths >= 8), then two rows and one row 3 and 5 tokens short of the
    longest (new lengths where buckets are more than 5 tokens apart), so that the graphs left are
    symbolic in rows and length (dynamo generalises a dimension once it changes)."""
    gen = torch.Generator().manual_seed(0)
    longest = shapes[-1][1]
    for rows, length in [*shapes, (2, longest - 3), (1, longest - 5)]:
        ids = torch.randint(0, target.vocab_size, (rows, length), generator=gen).to(target.device)
        target.features(ids, layer_ids)


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
    if cfg.fp8 != "off" and decoder and (problem := fp8_problem(device)):
        raise ValueError(f"target.fp8={cfg.fp8}: {problem}")  # before a big target loads
    if cfg.compile and cfg.tensor_parallel > 1:
        raise ValueError("target.compile with target.tensor_parallel > 1: compiled layers over sharded weights "
                         "are not tested here; set target.compile=false or target.tensor_parallel=1")
    dtype = pick_dtype(cfg.dtype, device)
    if cfg.fp8 == "rowwise" and decoder and dtype != torch.bfloat16:
        raise ValueError(f"target.fp8=rowwise: torchao's per-row FP8 quantises bfloat16 weights, and the target "
                         f"loads in {dtype}; set target.dtype=bfloat16, or target.fp8=tensorwise")
    path = resolve_target_path(cfg.path)
    tokenizer = load_tokenizer(path)
    # auto: transformers' own choice, SDPA where the family supports it, else eager (gpt-oss's sinks)
    attention = None if cfg.attn_implementation == "auto" else cfg.attn_implementation
    # use_kernels=False: transformers >= 5.25 swaps layers for Hub kernels by default, fetched at load
    # time; the target must run the code this package was tested with, offline too.
    model = load_pretrained(AutoModelForCausalLM, path, dtype=dtype, attn_implementation=attention,
                            use_kernels=False)
    if not decoder:
        layers = decoder_layers(model)
        for i in range(len(layers)):
            layers[i] = nn.Identity()
    elif mesh is not None:
        shard_decoder(model, mesh)
    model.to(device).eval().requires_grad_(False)
    if cfg.fp8 != "off" and decoder:
        if mesh is not None:
            raise ValueError("target.fp8 with target.tensor_parallel > 1: FP8 weights are not sharded; "
                             "set target.tensor_parallel=1 or target.fp8=off")
        quantize_decoder(decoder_layers(model), cfg.fp8)
    return Target(model=model, tokenizer=tokenizer, name=cfg.path, device=device, fp8=cfg.fp8)
