"""`cleave status` tells a job whose runner is gone from one that runs, and a submission no runner has taken
from a job the hub does not know. It showed a job whose runner had died as `running` for ever, and said 'the
hub knows no job' of a job `cleave submit` had just said waits on the hub. A real nats-server; the runner's
own code stamps the records (`Runner.vouch`)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path

import pytest

from cleave import bus as busmod
from cleave import codec
from cleave.api import hub
from cleave.api.stack import Stack
from cleave.schemas import JOBS_BUCKET, SUBJECT_JOB_SUBMIT, JobRecord, JobSubmission, StepMetrics
from cleave.schemas.jobs import RUNNER_REFRESH_S, RUNNER_SILENT_S
from cleave.train.job import JobConfig
from cleave_cli.main import main
from cleave_cli.runner import Runner, jobs_stream

GONE_S = 600.0  # how long ago the dead runner last stamped its record


def _record(job_id: str, state: str, heard_at: float | None) -> JobRecord:
    job = JobConfig.build(job_id=job_id, preset="tiny", steps=8)
    return JobRecord(job_id=job_id, job=job.model_dump_json(), state=state, submitted_at=time.time() - 900,
                     runs=1, heard_at=heard_at)


async def _seed(nats_url: str) -> None:
    """What a hub whose runner died holds: a running job last stamped GONE_S ago with two steps reported, a done
    job, and a submission no runner has taken."""
    bus = await busmod.connect(nats_url, "test")
    await bus.setup()
    await jobs_stream(bus)
    kv = await bus.kv(JOBS_BUCKET)
    now = time.time()
    await bus.kv_put(kv, "orphan", _record("orphan", "running", now - GONE_S))
    await bus.kv_put(kv, "finished", _record("finished", "done", now - GONE_S))
    for step, loss in enumerate((5.5, 5.25)):
        await bus.emit(StepMetrics(job="orphan", step=step, loss=loss, step_time_s=0.1, workers=2))
    await bus.emit(StepMetrics(job="finished", step=7, loss=3.0, step_time_s=0.1, workers=2))
    sub = JobSubmission(job=JobConfig.build(job_id="later", preset="tiny").model_dump_json(),
                        nonce=secrets.token_hex(8), submitted_at=now)
    await bus.js.publish(SUBJECT_JOB_SUBMIT.format(job="later"), codec.encode(sub))
    await bus.close()


def test_status_says_a_runner_is_gone_and_a_submission_waits(nats_url: str, capsys: pytest.CaptureFixture) -> None:
    asyncio.run(_seed(nats_url))
    assert main(["status", "--nats", nats_url, "--job-id", "orphan"]) == 0
    said = capsys.readouterr().out
    assert "orphan: running, step 1 (2/8 done), loss 5.2500" in said and "not heard from the hub's runner for 10 min" \
        in said, said
    assert main(["status", "--nats", nats_url, "--job-id", "finished"]) == 0
    assert "not heard" not in capsys.readouterr().out  # a job that ended needs no runner
    assert main(["status", "--nats", nats_url, "--job-id", "later"]) == 0
    assert "later: submitted, waiting on the hub for its runner to take it" in capsys.readouterr().out
    assert main(["status", "--nats", nats_url]) == 0
    listed = {x.split()[0]: x for x in capsys.readouterr().out.splitlines()}
    assert sorted(listed) == ["finished", "later", "orphan"] and "not heard" in listed["orphan"], listed
    assert "waiting on the hub for its runner" in listed["later"] and "not heard" not in listed["finished"]
    assert main(["status", "--nats", nats_url, "--json"]) == 0
    views = {v["job"]: v for v in json.loads(capsys.readouterr().out)}
    assert views["later"]["state"] == "submitted"
    assert (views["orphan"]["step"], views["orphan"]["loss"], views["finished"]["step"]) == (1, 5.25, 7)
    assert abs(views["orphan"]["runner_silent_s"] - GONE_S) < 60 and views["finished"]["runner_silent_s"] is None
    assert sorted(v["job"] for v in hub.status(nats_url)) == ["finished", "orphan"]  # the API: the records


def test_a_live_runner_stamps_its_queued_and_running_jobs(nats_url: str, tmp_path: Path) -> None:
    async def go() -> dict[str, float | None]:
        bus = await busmod.connect(nats_url, "test")
        await bus.setup()
        runner = Runner(bus, Stack(tmp_path / "run"), tmp_path / "run", max_running=1)
        runner.kv = await bus.kv(JOBS_BUCKET)
        now = time.time()
        for job_id, state, at in (("old", "running", now - RUNNER_REFRESH_S - 1), ("fresh", "queued", now - 1),
                                  ("ended", "failed", now - RUNNER_SILENT_S * 2)):
            runner.records[job_id] = _record(job_id, state, at)
        await runner.vouch()
        stamped = {k: (await bus.kv_get(runner.kv, k, JobRecord)) for k in ("old", "fresh", "ended")}
        await bus.close()
        return {k: got[0].heard_at if got else None for k, got in stamped.items()}

    stamped = asyncio.run(go())
    assert stamped["old"] is not None and time.time() - stamped["old"] < 30  # written again, stamped now
    assert stamped["fresh"] is None and stamped["ended"] is None  # stamped recently / ended: not written
