"""benchmarks/gpu.py's own path, run here with a tiny preset, so that it works the first time a GPU machine
is at hand: the reference and the distributed run side by side, every process's memory recorded at exit,
the JSON written. On the CPU the losses are bitwise equal; on a GPU (cuBLAS picks kernels by shape) close."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[2] / "benchmarks" / "gpu.py"


@pytest.mark.slow  # ~14 s; the benchmark's CPU path (benchmarks/gpu_check.sh runs it with the device tests)
def test_gpu_benchmark_runs_its_tiny_preset(tmp_path):
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, str(BENCH), "--models", "tiny", "--steps", "2", "--workers", "2",
                    "--out", str(out)], check=True, capture_output=True, timeout=240)
    (row,) = json.loads(out.read_text())["rows"]
    assert "failed" not in row and "stopped" not in row, row
    assert len(row["losses"]) == len(row["reference_losses"]) == 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the envelope of every exactness test (tests/integration/fleet.py assert_same): a tile cut differently
    # (after a worker is lost or a plan changes under load) may round its sums over K in another order
    assert row["max_rel_loss_diff"] <= 1e-4, row
    assert row["median_step_s"] > 0 and row["reference_median_step_s"] > 0 and row["step_ratio"] > 0
    assert row["ps_peak_rss_gb"] > 0 and row["reference_peak_rss_gb"] > 0 and row["rss_ratio"] > 0
    assert len(row["workers_peak_rss_gb"]) == 2 and all(g > 0 for g in row["workers_peak_rss_gb"])
    assert row["devices"]["ps"].startswith("cpu") == (device == "cpu")
    if device == "cuda":  # every process computed on the GPU and said how much of it it took
        assert row["ps_cuda_max_allocated_gb"] > 0 and row["reference_cuda_max_allocated_gb"] > 0
        assert all(g > 0 for g in row["workers_cuda_max_allocated_gb"])
    else:
        assert row["ps_cuda_max_allocated_gb"] is None and row["devices"]["workers"] == ["cpu"]
