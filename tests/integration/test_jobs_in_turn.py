"""Jobs one after another on the same workers (a hub's runner does this all day): each is exact and keeps
every worker. Every job's PS numbers its tensors from 1 in its first epoch, so a worker's cache must tell the
jobs' blocks apart: it did not, and the second job's tiles multiplied the first job's cached blocks, failed
Freivalds' check, and its honest workers were expelled as liars (the job hung once all were)."""

from __future__ import annotations

from pathlib import Path

from cleave.api.fleet import LocalFleet, run_reference
from cleave.train.job import JobConfig
from tests.integration.fleet import assert_same


def test_a_second_job_on_the_same_workers_is_exact_and_keeps_them(tmp_path: Path, nats_url: str) -> None:
    fleet = LocalFleet(tmp_path / "run", 2, nats_url=nats_url)
    fleet.start()
    try:
        for job_id, steps in (("first", 12), ("second", 20)):
            job = JobConfig(job_id=job_id, preset="tiny", steps=steps)
            metrics = tmp_path / f"{job_id}.jsonl"
            fleet.start_ps(job, metrics)
            lines = fleet.wait_ps(metrics, timeout_s=240)
            ref = run_reference(job, tmp_path / f"{job_id}-reference.jsonl")
            assert_same([m["loss"] for m in lines], [m["loss"] for m in ref])
            assert all(m["workers"] == 2 for m in lines), [m["workers"] for m in lines]
        log = (tmp_path / "run" / "logs" / "ps.log").read_text()
        assert "worker_faulty" not in log, [line for line in log.splitlines() if "worker_faulty" in line][:3]
    finally:
        fleet.stop()
