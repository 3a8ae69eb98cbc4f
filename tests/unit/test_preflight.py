"""The preflight: the PS's memory estimate, and a job that cannot fit refused naming the knob."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cleave.errors import ConfigError
from cleave.train import preflight
from cleave.train.job import JobConfig


def test_the_estimate_counts_four_copies_of_the_weights_and_activations_grow_with_the_batch() -> None:
    one = preflight.estimate(JobConfig(preset="small", batch_size=1, seq_len=64), workers=2)
    four = preflight.estimate(JobConfig(preset="small", batch_size=4, seq_len=64), workers=2)
    assert one.weights == one.grads == 4 * one.params and one.optimizer == 8 * one.params
    assert 3.5 < four.activations / one.activations < 4.5
    assert four.total > one.total > one.weights * 4
    assert preflight.estimate(JobConfig(preset="small", batch_size=1, seq_len=64), workers=8).largest_tile[-1] \
        < one.largest_tile[-1]  # more workers, smaller tiles


@pytest.mark.parametrize(("memory", "knob"), [(0.6e9, "lower batch_size .now 64. or seq_len"),
                                              (0.2e9, "choose a smaller model .preset.")])
def test_a_job_that_cannot_fit_is_refused_naming_the_knob(memory: float, knob: str) -> None:
    job = JobConfig(preset="small", batch_size=64)
    est = preflight.estimate(job, workers=2)
    assert est.total > 0.6e9 and est.weights * 4 + est.runtime < 0.6e9
    with pytest.raises(ConfigError, match=f"needs about .* GB on the PS .* are available; to fit, .*{knob}"):
        preflight.check(job, est, int(memory))
    preflight.check(job, est, est.total + 1)  # fits: nothing raised


def test_train_dry_run_prints_the_estimate_and_refuses_what_cannot_fit(tmp_path) -> None:
    def dry(memory: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "cleave_cli", "train", "--preset", "small", "--batch-size", "64",
             "--dry-run", "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
            env={**os.environ, "CLEAVE_PS_MEMORY_BYTES": str(memory)})

    ok = dry(10**12)
    assert ok.returncode == 0 and "PS peak" in ok.stdout and "activations" in ok.stdout and "fits" in ok.stdout
    refused = dry(5 * 10**8)
    assert refused.returncode == 2 and "lower batch_size (now 64)" in refused.stderr, refused.stderr
