"""Targets that ship in PyPI packages as GGUF files, converted once into a plain HF model directory.

`smollm2` (SmolLM2-135M-Instruct, Llama) and `gemma3-270m` (Gemma 3 270M base: sliding-window and
global layers, 262K vocabulary, tied embeddings) are dequantised to fp32 safetensors and cached under
`cache_home()/models`. The directory is written for the serving stacks too: SGLang, vLLM and z-lab's
reference code pin transformers 4.x, which knows neither the tokenizer class name transformers 5
writes (`TokenizersBackend`) nor rope settings kept only in `rope_parameters` (given the weights, it
would silently fall back to rope theta 1e4). `legacy_fields` adds what 4.x reads, beside what 5.x reads.
"""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
from pathlib import Path

from dflash_train.atomic import new_temp_dir, swap_dir, write_json_atomic
from dflash_train.disk import require_writable
from dflash_train.package_data import GEMMA3_270M_GGUF, SMOLLM2_GGUF, cache_home, packaged_file

log = logging.getLogger("dflash_train")

EMBEDDED_TARGETS = {
    "smollm2": (SMOLLM2_GGUF, "SmolLM2-135M-Instruct"),
    "gemma3-270m": (GEMMA3_270M_GGUF, "gemma-3-270m"),
}
CONVERSION_VERSION = 3
"""Bumped when the conversion changes, so stale caches are rebuilt (v2: tokenizer EOS fixed; v3:
fields transformers 4.x reads)."""

FAST_TOKENIZER = "PreTrainedTokenizerFast"
"""The tokenizer class every transformers version loads from tokenizer.json alone."""
TOKENIZER_CLASSES = {"SmolLM2-135M-Instruct": FAST_TOKENIZER, "gemma-3-270m": "GemmaTokenizer"}
"""The class AutoTokenizer loads from each converted directory (tests/targets/test_tokenizer.py checks
it). Named, it loads without AutoTokenizer, whose imports (torch, the model's config class) were most
of `prepare`'s fixed seconds."""


def converted_target(name: str) -> Path:
    """The embedded target's converted directory, converting it the first time."""
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
        return convert(packaged, model_name, out)


def converted_tokenizer_class(path: str | Path) -> str | None:
    """The tokenizer class of an embedded target's converted directory; None for any other path."""
    for _, model_name in EMBEDDED_TARGETS.values():
        if Path(path) == cache_home() / "models" / f"{model_name}.v{CONVERSION_VERSION}":
            return TOKENIZER_CLASSES[model_name]
    return None


def convert(packaged, model_name: str, out: Path) -> Path:
    import torch  # here, not at the top: a converted target's users (`prepare`) need neither
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = packaged_file(packaged)
    src, gguf_file = gguf.parent, gguf.name
    log.info("converting %s from GGUF once (cached at %s)", model_name, out)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    quantised = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32,
                                                     use_kernels=False)  # as targets/model.py loads
    config = quantised.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.generation_config = quantised.generation_config
    # SmolLM2's GGUF metadata names <|im_start|> as EOS; the model ends turns with config.eos_token_id.
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    tmp = new_temp_dir(out)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        legacy_fields(tmp)
        return swap_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def legacy_rope_fields(config: dict) -> dict:
    """The rope keys transformers 4.x reads, from 5.x's `rope_parameters` (flat, or one entry per
    layer type: Gemma 3's global layers take `rope_theta`, its sliding layers `rope_local_base_freq`)."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict):
        return {}
    per_type = {k: v for k, v in params.items() if isinstance(v, dict)}
    main = per_type.get("full_attention", params if not per_type else None)
    out = {}
    if main is not None and "rope_theta" in main:
        out["rope_theta"] = main["rope_theta"]
        scaling = {k: v for k, v in main.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") != "default":
            out["rope_scaling"] = scaling
    if "sliding_attention" in per_type and "rope_theta" in per_type["sliding_attention"]:
        out["rope_local_base_freq"] = per_type["sliding_attention"]["rope_theta"]
    return out


def legacy_fields(model_dir: Path) -> None:
    """config.json and tokenizer_config.json of `model_dir` gain the fields transformers 4.x reads
    (kept beside 5.x's own, which 5.x still reads first)."""
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    write_json_atomic(config_path, {**config, **legacy_rope_fields(config)})
    tok_path = model_dir / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    if tok.get("tokenizer_class") == "TokenizersBackend":  # transformers 5's name; 4.x has no such class
        write_json_atomic(tok_path, {**tok, "tokenizer_class": FAST_TOKENIZER})
