"""The throughput benchmark keeps working: its CPU mode runs in CI (figures come from the H200)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from throughput import main  # noqa: E402


@pytest.mark.slow
def test_throughput_benchmark_cpu_mode(tmp_path):
    out = tmp_path / "bench.json"
    result = main(["--tiny", "--steps", "1", "--out", str(out)])
    assert out.is_file()
    for key in ("target_tokens_per_s", "drafter_tokens_per_s", "e2e_tokens_per_s"):
        assert result[key] > 0
    assert result["anchors"] == 16 and result["block_size"] == 16
