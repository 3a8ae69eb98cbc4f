"""Cancelling and forgetting a job on a hub (`cleave cancel`, `cleave forget`): a real nats-server, the runner's own
code, real PS and worker processes and the real command line.

- A running job's PS is stopped (SIGTERM: it drains and exits 0), not started again, and its record says
  `cancelled` with the PS's exit status; submitting the job again runs it (a second run of the same record).
- A queued job that is cancelled never starts; a cancelled job whose PS still stops counts as running, so the
  next job does not start beside it.
- Cancelling a job that ended says so and changes nothing; cancelling a job the hub does not know is an error.
- Forgetting an ended job deletes its record, head, checkpoint, step lines, folder and log, and nothing of another
  job; a new job of its id is then judged as a new job. A running job is not forgotten; nor is any without a yes.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

from nats.js.api import DeliverPolicy

from cleave import bus as busmod
from cleave import codec
from cleave.api import hub
from cleave.api.stack import Stack
from cleave.bus import history
from cleave.errors import EXIT_ERROR
from cleave.schemas import (
    EVENTS_STREAM,
    JOBS_BUCKET,
    STATE_BUCKET,
    STATE_OBJECTS,
    SUBJECT_JOB_SUBMIT,
    Event,
    JobRecord,
    JobSubmission,
    StepMetrics,
    events_subject,
)
from cleave.schemas.subjects import kv_stream, kv_subject
from cleave.train.job import JobConfig
from cleave_cli.runner import Runner
from tests.integration.fleet import start_fleet

OP_TIMEOUT_S = 120.0


def _job(job_id: str, **settings: int) -> str:
    return JobConfig.build(job_id=job_id, preset="tiny", batch_size=2, **{"steps": 100_000, **settings}).model_dump_json()


async def _submit(bus: busmod.Bus, job_id: str, nonce: int, action: str = "run", **settings: int) -> None:
    sub = JobSubmission(job=_job(job_id, **settings) if action == "run" else "{}", nonce=f"{nonce:016x}",
                        submitted_at=time.time(), action=action)
    await bus.js.publish(SUBJECT_JOB_SUBMIT.format(job=job_id), codec.encode(sub))


async def _ticking(runner: Runner, until: Callable[[], bool], check: Callable[[], None] = lambda: None) -> None:
    """Run the runner (take submissions, look after its PSs) until `until()`, calling `check()` each round."""
    async with asyncio.timeout(OP_TIMEOUT_S):
        while not until():
            await runner.take()
            await runner.tick()
            check()


def _state(runner: Runner, job_id: str) -> str | None:
    rec = runner.records.get(job_id)
    return rec.state if rec else None


async def _cli(runner: Runner, *argv: str) -> tuple[int, str]:
    """`cleave <argv>` in its own process, while the runner goes on answering."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "cleave_cli", *argv,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    done = asyncio.ensure_future(proc.communicate())
    await _ticking(runner, done.done)
    return proc.returncode, done.result()[0].decode()


def _run(nats_url: str, run: Path, go: Callable) -> None:  # noqa: ANN001
    async def main() -> None:
        bus = await busmod.connect(nats_url, "test")
        await bus.setup()
        stack = Stack(run)
        stack.nats_url = nats_url
        runner = Runner(bus, stack, run, max_running=1)
        await runner.open()
        try:
            await go(bus, runner)
        finally:
            await asyncio.to_thread(runner.stack.stop_all)
            await runner.close()
            await bus.close()

    asyncio.run(main())


def test_a_running_job_is_cancelled_its_ps_stops_and_a_new_submission_runs_it(nats_url: str, tmp_path: Path) -> None:
    async def go(bus: busmod.Bus, runner: Runner) -> None:
        await _submit(bus, "long", 1)
        log = runner.stack.log_path("ps-long")
        await _ticking(runner, lambda: log.exists() and "ps_started" in log.read_text())  # (it has claimed its state)

        code, out = await _cli(runner, "cancel", "--nats", nats_url, "--job-id", "long")
        assert code == 0 and "long: cancelled" in out, out
        rec: JobRecord = runner.records["long"]
        assert rec.state == "cancelled" and rec.reason.startswith("cancelled by its submitter at "), rec
        await _ticking(runner, lambda: runner.records["long"].exit_code is not None)  # its PS stopped ...
        assert runner.records["long"].exit_code == 0  # ... as a PS told to stop does: it drained
        for _ in range(6):  # and is not started again
            await runner.tick()
            await asyncio.sleep(0.25)
        assert not runner.alive("long") and runner.records["long"].state == "cancelled"
        assert runner.records["long"].runs == 1

        code, out = await _cli(runner, "cancel", "--nats", nats_url, "--job-id", "long")
        assert code == 0 and "had already ended (cancelled)" in out, out
        code, out = await _cli(runner, "cancel", "--nats", nats_url, "--job-id", "nosuch")
        assert code == EXIT_ERROR and "knows no job 'nosuch'" in out, out

        await _submit(bus, "long", 2)  # submitted again: it runs (and resumes from whatever it committed)
        await _ticking(runner, lambda: _state(runner, "long") == "running")
        assert runner.records["long"].runs == 2 and runner.alive("long")

    _run(nats_url, tmp_path / "run", go)


def test_a_cancelled_queued_job_never_starts_and_a_stopping_ps_holds_the_next_job(nats_url: str,
                                                                                 tmp_path: Path) -> None:
    async def go(bus: busmod.Bus, runner: Runner) -> None:
        await _submit(bus, "first", 1)
        log = runner.stack.log_path("ps-first")
        await _ticking(runner, lambda: log.exists() and "ps_started" in log.read_text())
        await _submit(bus, "second", 2)
        await _submit(bus, "third", 3)
        await _ticking(runner, lambda: _state(runner, "third") == "queued")
        await _submit(bus, "second", 4, action="cancel")
        await _ticking(runner, lambda: _state(runner, "second") == "cancelled")
        await _submit(bus, "first", 5, action="cancel")

        def one_at_a_time() -> None:
            assert not (_state(runner, "third") == "running" and runner.alive("first")), "two PSs at once"

        await _ticking(runner, lambda: _state(runner, "third") == "running", one_at_a_time)
        assert runner.records["first"].state == "cancelled" and runner.records["first"].exit_code is not None
        second = runner.records["second"]
        assert second.state == "cancelled" and second.started_at is None and second.runs == 0, second

    _run(nats_url, tmp_path / "run", go)


async def _jobs_of(bus: busmod.Bus, kind: str) -> list[str]:
    """The jobs the events of `kind` in the events stream name, oldest first ("": an event of the fleet)."""
    found = await history.numbered(bus.js, EVENTS_STREAM, events_subject(kind), Event, DeliverPolicy.ALL)
    return [e.job for _, e in found]


def test_an_ended_job_is_forgotten_whole_and_a_running_one_is_not(nats_url: str, tmp_path: Path) -> None:
    fleet = start_fleet(tmp_path / "fleet", nats_url, workers=1)

    async def go(bus: busmod.Bus, runner: Runner) -> None:
        await _submit(bus, "old", 1, steps=3)
        await _ticking(runner, lambda: _state(runner, "old") == "done")
        await bus.emit(StepMetrics(job="older", step=0, loss=1.0, step_time_s=0.1, workers=1))  # another job's line
        await bus.emit(Event(kind="worker_joined", at=1.0, worker_id="w9"))  # the fleet's: of no job
        await _submit(bus, "old", 2, steps=3, seed=7)  # another model under its id: refused while it has state
        await _ticking(runner, lambda: runner.records["old"].verdict == "refused")
        await _submit(bus, "long", 3)
        await _ticking(runner, lambda: _state(runner, "long") == "running")

        forget = ("forget", "--nats", nats_url, "--job-id")
        code, out = await _cli(runner, *forget, "old")  # (no terminal to ask, no --yes)
        assert code == EXIT_ERROR and "pass --yes" in out, out
        code, out = await _cli(runner, *forget, "long", "--yes")
        assert code == EXIT_ERROR and "'long' is running: cancel it first" in out, out
        state, objects = await bus.kv(STATE_BUCKET, history=5), await bus.object_store(STATE_OBJECTS)
        folder, log = runner.run_dir / "jobs" / "old", runner.stack.log_path("ps-old")
        assert "old.head" in await bus.keys(state) and folder.exists() and log.exists()
        assert runner.alive("long") and "old" in await hub.read_lasts(bus)
        assert "old" in await _jobs_of(bus, "job_done") and "" in await _jobs_of(bus, "worker_joined")

        code, out = await _cli(runner, *forget, "old", "--yes")
        assert code == 0 and "old: forgotten" in out, out
        assert await hub.read_records(bus, "old") == [] and "old" not in runner.records
        marker = await bus.js.get_last_msg(kv_stream(JOBS_BUCKET), kv_subject(JOBS_BUCKET, "old"))
        assert marker.headers["KV-Operation"] == "PURGE"  # (what tells a watching dashboard)
        assert "old.head" not in await bus.keys(state) and "long.head" in await bus.keys(state)
        names = [o.name for o in await objects.list(ignore_deletes=True)]
        assert names and not [n for n in names if n.startswith("old/")], names
        assert "old" not in await hub.read_lasts(bus) and "older" in await hub.read_lasts(bus)
        assert "old" not in await _jobs_of(bus, "job_done") and "" in await _jobs_of(bus, "worker_joined")
        assert not folder.exists() and not log.exists() and (runner.run_dir / "jobs" / "long").exists()
        code, out = await _cli(runner, *forget, "old", "--yes")
        assert code == EXIT_ERROR and "no record of job 'old'" in out, out

        await _submit(bus, "old", 4, steps=3, seed=7)  # a new job of that id
        await _ticking(runner, lambda: runner.records.get("old") is not None)
        assert (runner.records["old"].state, runner.records["old"].verdict) == ("queued", "accepted")

    try:
        _run(nats_url, tmp_path / "run", go)
    finally:
        fleet.stop()
