"""Cancelling a job on a hub (`cleave cancel`): a real nats-server, the runner's own code, real PS processes and the
real command line.

- A running job's PS is stopped (SIGTERM: it drains and exits 0), not started again, and its record says
  `cancelled` with the PS's exit status; submitting the job again runs it (a second run of the same record).
- A queued job that is cancelled never starts; a cancelled job whose PS still stops counts as running, so the
  next job does not start beside it.
- Cancelling a job that ended says so and changes nothing; cancelling a job the hub does not know is an error.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cleave import bus as busmod
from cleave import codec
from cleave.api.stack import Stack
from cleave.errors import EXIT_ERROR
from cleave.schemas import SUBJECT_JOB_SUBMIT, JobRecord, JobSubmission
from cleave.train.job import JobConfig
from cleave_cli.runner import Runner

OP_TIMEOUT_S = 120.0


def _job(job_id: str) -> str:
    return JobConfig.build(job_id=job_id, preset="tiny", steps=100_000, batch_size=2).model_dump_json()


async def _submit(bus: busmod.Bus, job_id: str, nonce: int, action: str = "run") -> None:
    sub = JobSubmission(job=_job(job_id) if action == "run" else "{}", nonce=f"{nonce:016x}",
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
