"""The CUDA toolkit parts a CUDA build of llama.cpp needs: nvcc, and cuBLAS (headers and libraries).

llama.cpp's CUDA backend links cuBLAS. A toolkit installed whole has it beside nvcc; many GPU images
ship nvcc without it, while the PyTorch in them brought cuBLAS as a wheel (`nvidia-cublas`: headers
and the versioned libraries, `nvidia/cu13/` for CUDA 13, `nvidia/cublas/` for CUDA 12). CMake's
FindCUDAToolkit looks only beside nvcc and for unversioned library names, so the wheel's copy is
handed to it by path; the server then finds those libraries through the build's RPATH.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

WHEEL_DIRS = ("cu{major}", "cublas")
"""Where an nvidia-cublas wheel puts cuBLAS under the `nvidia` package (CUDA 13, then CUDA 12)."""


class CudaToolkitError(RuntimeError):
    pass


def nvcc_major(nvcc: Path) -> str:
    """The CUDA major version nvcc reports ("13" for `release 13.0, V13.0.88`)."""
    done = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60)
    found = re.search(r"release (\d+)\.", done.stdout)
    if found is None:
        raise CudaToolkitError(f"{nvcc} --version names no release: {done.stdout.strip()[-200:]}")
    return found.group(1)


def _has_cublas(include: Path, lib: Path, suffix: str) -> bool:
    return (include / "cublas_v2.h").is_file() and (lib / f"libcublas.so{suffix}").exists()


def wheel_roots() -> list[Path]:
    """The folders of the `nvidia` namespace package in this Python (where torch's CUDA wheels lie)."""
    try:
        import nvidia  # a namespace package: no __init__, one folder per site-packages that has it
    except ImportError:
        return []
    return [Path(p) for p in getattr(nvidia, "__path__", [])]


def cublas_flags(nvcc: Path | None = None, roots: list[Path] | None = None) -> list[str]:
    """CMake flags that give a CUDA build cuBLAS: none when the toolkit holds it beside nvcc, else the
    nvidia-cublas wheel of nvcc's CUDA major version found in `roots` (default: this Python's)."""
    nvcc = nvcc or (Path(shutil.which("nvcc") or ""))
    if not nvcc.is_file():
        raise CudaToolkitError("a CUDA build needs nvcc on PATH (the CUDA toolkit's compiler)")
    toolkit = nvcc.resolve().parent.parent
    for lib in ("lib64", "lib", "targets/x86_64-linux/lib"):
        if _has_cublas(toolkit / "include", toolkit / lib, ""):
            return []
    major = nvcc_major(nvcc)
    for root in wheel_roots() if roots is None else roots:
        for name in WHEEL_DIRS:
            here = root / name.format(major=major)
            include, lib = here / "include", here / "lib"
            if _has_cublas(include, lib, f".{major}") and (lib / f"libcublasLt.so.{major}").exists():
                return [f"-DCUDA_cublas_LIBRARY={lib / f'libcublas.so.{major}'}",
                        f"-DCUDA_cublasLt_LIBRARY={lib / f'libcublasLt.so.{major}'}",
                        f"-DCMAKE_CUDA_FLAGS=-I{include}", f"-DCMAKE_CXX_FLAGS=-I{include}"]
    raise CudaToolkitError(f"a CUDA build needs cuBLAS: the toolkit at {toolkit} has none and this Python has no "
                           f"nvidia-cublas wheel for CUDA {major} (pip install 'nvidia-cublas=={major}.*')")
