"""Resume by job id, on a real local stack: a job resumed with more steps continues from its last commit and its
metrics file grows (never truncated); the same id with another seed is refused once with the settings that
differ (exit 4) and not started again; a new job sets another job's metrics file aside. Slow: three PS starts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from cleave.api.fleet import LocalFleet, run_reference
from cleave.errors import EXIT_JOB_FAILED, PsEnded
from cleave.train.job import JobConfig
from tests.integration.fleet import assert_same

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def steps_of(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


def test_more_steps_continue_a_changed_seed_is_refused_once_and_metrics_only_grow(tmp_path: Path) -> None:
    job_id = f"resume-{time.time_ns()}"
    metrics = tmp_path / "metrics.jsonl"
    fleet = LocalFleet(tmp_path / "run", 2)
    try:
        fleet.start()
        fleet.start_ps(JobConfig.build(job_id=job_id, preset="tiny", steps=3), metrics)
        fleet.wait_ps(metrics, timeout_s=300)
        assert steps_of(metrics) == [0, 1, 2]
        longer = JobConfig.build(job_id=job_id, preset="tiny", steps=5)
        fleet.start_ps(longer, metrics)
        lines = fleet.wait_ps(metrics, timeout_s=300)
        assert steps_of(metrics) == [0, 1, 2, 3, 4]  # appended, each step once
        assert [m["step"] for m in lines] == [0, 1, 2, 3, 4]
        log = (tmp_path / "run" / "logs" / "ps.log").read_text()
        assert "job_settings_changed" in log and "steps='3 -> 5'" in log and "from_step=3" in log
        fleet.start_ps(JobConfig.build(job_id=job_id, preset="tiny", steps=5, seed=7), metrics)
        with pytest.raises(PsEnded, match=f"exited with {EXIT_JOB_FAILED}") as ended:
            fleet.wait_ps(metrics, timeout_s=300)
        assert ended.value.exit_code == EXIT_JOB_FAILED  # `cleave train` ends with it too
        ps = fleet.stack.procs["ps"]
        assert ps.restarts == 0, "a changed identity is refused once, never restarted"
        said = (tmp_path / "run" / "logs" / "ps.log").read_text()[ps.log_offset:]
        assert "of another model, data order or privacy noise: seed: 0 -> 7" in said
        assert steps_of(metrics) == [0, 1, 2, 3, 4]  # nothing written, nothing deleted
        other = JobConfig.build(job_id=f"{job_id}-b", preset="tiny", steps=1)
        fleet.start_ps(other, metrics)
        fleet.wait_ps(metrics, timeout_s=300)
        assert steps_of(metrics) == [0]
        (kept,) = tmp_path.glob(f"metrics.before-{job_id}-b-*.jsonl")
        assert steps_of(kept) == [0, 1, 2, 3, 4]
    finally:
        fleet.stop()
    ref = run_reference(JobConfig.build(job_id=job_id, preset="tiny", steps=3), tmp_path / "reference.jsonl")
    assert_same([m["loss"] for m in lines[:3]], [m["loss"] for m in ref])  # the first run, as the reference
