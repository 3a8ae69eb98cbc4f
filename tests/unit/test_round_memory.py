"""A worker checks that a round of a job fits its memory before it builds anything, and refuses with the numbers."""

from __future__ import annotations

import pytest

from cleave.errors import JobRefused
from cleave.train.job import JobConfig
from cleave_worker.local_rounds import check_memory, round_memory


def test_a_round_that_does_not_fit_is_refused_with_the_numbers_and_the_knob():
    job = JobConfig(job_id="big", preset="small", method="fedavg")
    need = round_memory(job)
    params = need["weights"] // 4
    assert need["optimizer"] == 8 * params and need["gradients"] == 4 * params and need["activations"] > 0
    check_memory(job, sum(need.values()) + 1)  # fits
    with pytest.raises(JobRefused, match=r"needs about .* GB here .*CLEAVE_WORKER_ROUND_MEMORY_BYTES"):
        check_memory(job, sum(need.values()) - 1)


def test_lora_trains_and_keeps_state_for_the_adapters_only():
    full = round_memory(JobConfig(preset="small", method="fedavg"))
    lora = round_memory(JobConfig(preset="small", method="fedavg", lora_rank=4))
    assert lora["weights"] == full["weights"] and lora["optimizer"] < full["optimizer"] / 10
