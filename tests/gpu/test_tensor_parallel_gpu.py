"""On two CUDA GPUs (NCCL): a Qwen3-8B-shaped random target, 4 of its 36 layers, in float32, sharded
over both GPUs (target.tensor_parallel 2) captures the same features as the whole target on one.
Runs bench/tp_features.py through torchrun, the process layout `launch` uses.

On a GPU host: `python -m pytest tests/gpu -m gpu` (on a machine with 2 GPUs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


def test_sharded_8b_shaped_target_features_equal_the_whole_targets(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "bench" / "tp_features.py"), "--out", str(tmp_path), "--layers", "4", "--dtype", "float32",
           "--steps", "2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "tp_features.json").read_text())
    # fp32, TF32 off (torch's default): only the order of the row-wise all-reduce's sums differs.
    assert result["max_abs_diff"] <= 1e-5 * max(1.0, result["max_abs"]), result
