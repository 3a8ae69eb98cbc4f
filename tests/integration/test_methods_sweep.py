"""What a researcher sees when a round method's settings do not fit the fleet, over a real nats-server and
worker processes: the job's failure names the setting to change."""

from __future__ import annotations

import pytest

from cleave.api.fleet import LocalFleet
from cleave.errors import PsEnded
from cleave.train.job import JobConfig

SLOW = "flops=5e8,down=1e9,up=1e9,latency=0,memory=4Gi"  # a round of tiny at H=2 takes ~1.5 s there


def test_rounds_that_time_out_name_the_round_timeout(tmp_path):
    """A worker that cannot answer within round_timeout_s: the job fails saying so, with the option to raise."""
    job = JobConfig(job_id="short", preset="tiny", steps=2, method="diloco", local_steps=2, round_timeout_s=0.3,
                    max_empty_rounds=1)
    fleet = LocalFleet(tmp_path / "run", 0)
    try:
        fleet.start()
        fleet.stack.service("slow", "worker", ["--worker-id", "slow", "--profile", SLOW], restart=False)
        fleet.start_ps(job, tmp_path / "m.jsonl")
        with pytest.raises(PsEnded, match="exited with 4") as ended:
            fleet.wait_ps(tmp_path / "m.jsonl", timeout_s=120)
    finally:
        fleet.stop()
    assert "no update from slow within round_timeout_s=0.3 (--round-timeout)" in str(ended.value)


def test_split_learning_and_rounds_that_diverge_end_saying_so(tmp_path):
    """A learning rate far too high, one job after the other on one stack: split learning's gradient at the cut
    overflows, diloco's local steps diverge. The PS ends each job (status 4, not restarted into the same
    divergence) saying it diverged and what to lower."""
    jobs = {"split learning diverged at step": JobConfig(job_id="diverges", preset="tiny", steps=30, method="split",
                                                         lr=1000.0),
            "the local training diverged (a lower --lr may help)": JobConfig(
                job_id="rounds-diverge", preset="tiny", steps=3, method="diloco", local_steps=3, lr=1000.0,
                max_empty_rounds=1)}
    fleet = LocalFleet(tmp_path / "run", 1)
    try:
        fleet.start()
        for says, job in jobs.items():
            fleet.start_ps(job, tmp_path / f"{job.job_id}.jsonl")
            with pytest.raises(PsEnded, match="exited with 4") as ended:
                fleet.wait_ps(tmp_path / f"{job.job_id}.jsonl", timeout_s=120)
            assert says in str(ended.value) and "--lr" in str(ended.value), str(ended.value)
    finally:
        fleet.stop()
