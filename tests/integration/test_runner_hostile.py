"""The hub's runner under a hostile submitter (one holding the submit credential): a real nats-server, the
runner's own code, and real PS processes where a job starts.

- A PS that fails at start every time: its job fails after 5 tries, with a reason that says it was a crash loop,
  and the next job starts.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from cleave import bus as busmod
from cleave import codec
from cleave.api.stack import Stack
from cleave.schemas import SUBJECT_JOB_SUBMIT, JobRecord, JobSubmission
from cleave.train.job import JobConfig
from cleave_cli.runner import Runner

OP_TIMEOUT_S = 120.0
CRASH = """import os, sys
_a = [x.decode() for x in open("/proc/self/cmdline", "rb").read().split(b"\\0")]
if _a[1:4] == ["-m", "cleave_cli", "ps"] and any("/jobs/crashy/" in x for x in _a):
    sys.stderr.write("simulated broken install: this PS crashes at start\\n")
    os._exit(1)
"""


def _job(job_id: str, **settings: object) -> str:
    return JobConfig.build(**{"job_id": job_id, "preset": "tiny", "steps": 2, "batch_size": 2, **settings}).model_dump_json()


async def _submit(bus: busmod.Bus, job_id: str, text: str, nonce: int) -> None:
    sub = JobSubmission(job=text, nonce=f"{nonce:016x}", submitted_at=time.time())
    await bus.js.publish(SUBJECT_JOB_SUBMIT.format(job=job_id), codec.encode(sub))


async def _runner(nats_url: str, run: Path, **kw: object) -> tuple[busmod.Bus, Runner]:
    bus = await busmod.connect(nats_url, "test")
    await bus.setup()
    stack = Stack(run)
    stack.nats_url = nats_url
    runner = Runner(bus, stack, run, max_running=1, **kw)
    await runner.open()
    return bus, runner


async def _judged(runner: Runner, job_id: str, nonce: int) -> JobRecord:
    async with asyncio.timeout(OP_TIMEOUT_S):
        while (rec := runner.records.get(job_id)) is None or rec.nonce != f"{nonce:016x}":
            await runner.take()
    return rec


def test_a_ps_in_a_crash_loop_fails_its_job_saying_so_and_the_next_job_starts(
        nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "crash").mkdir()
    (tmp_path / "crash" / "sitecustomize.py").write_text(CRASH)  # (only the PS of job `crashy`)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "crash"), os.environ.get("PYTHONPATH", "")]))

    async def go() -> dict[str, JobRecord]:
        bus, runner = await _runner(nats_url, tmp_path / "run")
        try:
            await _submit(bus, "crashy", _job("crashy"), 1)
            await _submit(bus, "next", _job("next", steps=100_000), 2)
            async with asyncio.timeout(OP_TIMEOUT_S):
                while (rec := runner.records.get("next")) is None or rec.state != "running":
                    await runner.take()
                    await runner.tick()
            return dict(runner.records)
        finally:
            await asyncio.to_thread(runner.stack.stop_all)
            await runner.close()
            await bus.close()

    recs = asyncio.run(go())
    crashy = recs["crashy"]
    assert (crashy.state, crashy.exit_code, crashy.runs) == ("failed", 1, 5), crashy
    assert crashy.reason.startswith("its PS failed 5 times in a row, each within 60 s of its start"), crashy.reason
    assert "simulated broken install: this PS crashes at start" in crashy.reason
