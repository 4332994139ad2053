"""Target and drafter to GGUF with llama.cpp's own converter (`convert_hf_to_gguf.py` of the tree
whose server loads them): the drafter takes its vocabulary and shared embeddings from the target
directory (`--target-model-dir`), as llama.cpp's docs convert z-lab's published drafters.

A converted target is kept beside the serve check's other files and reused while its source
config, weights' sizes and the output type are unchanged (an f32 SmolLM2 is 0.5 GB and 15 s).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from dflash_train.errors import UserError
from dflash_train.serve.llama_cpp import LlamaCpp

OUT_TYPES = ("f32", "bf16", "f16")


class ConversionError(UserError):
    pass


def _source_key(model_dir: Path, out_type: str) -> str:
    h = hashlib.sha256(out_type.encode())
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes() if f.suffix == ".json" else str(f.stat().st_size).encode())
    return h.hexdigest()[:16]


def convert(llama: LlamaCpp, model_dir: Path, out: Path, out_type: str, log_file: Path,
            target_dir: Path | None = None) -> Path:
    """`model_dir` -> `out` (GGUF); a drafter needs `target_dir`. Skipped when `out` was converted from
    the same files (a `.source` stamp beside it)."""
    if out_type not in OUT_TYPES:
        raise ConversionError(f"GGUF type {out_type!r}: one of {', '.join(OUT_TYPES)}")
    key = _source_key(model_dir, out_type) + (_source_key(target_dir, out_type) if target_dir else "")
    stamp = out.with_name(out.name + ".source")
    if out.is_file() and stamp.is_file() and stamp.read_text() == key:
        return out
    cmd = [sys.executable, str(llama.converter), str(model_dir), "--outtype", out_type, "--outfile", str(out)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    out.unlink(missing_ok=True)
    stamp.unlink(missing_ok=True)
    with open(log_file, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if done.returncode != 0 or not out.is_file():
        lines = [ln for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()]
        raise ConversionError(f"llama.cpp's converter refused {model_dir} (exit {done.returncode}): "
                              f"{lines[-1] if lines else 'no output'} (log {log_file})")
    stamp.write_text(key)
    return out

