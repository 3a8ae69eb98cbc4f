"""How a job ends when a step cannot finish: a GEMM past `gemm_timeout_s` (no worker answers: a hung or hostile
fleet) aborts the step, nothing of it is applied or committed, and the job exits 4 (`EXIT_JOB_FAILED`, which the
supervisor does not restart), never 0 as if it were done; a step aborted because a stop was asked for is a clean
stop (0)."""

from __future__ import annotations

import asyncio

from cleave import bus as busmod
from cleave.errors import EXIT_JOB_FAILED, EXIT_OK
from cleave.schemas import STATE_BUCKET, StateHead
from cleave.train.job import JobConfig
from cleave_ps.jobs import lifecycle
from cleave_ps.jobs.pretrain import Pretrain
from cleave_ps.settings import PsSettings


class Watched(Pretrain):
    """The pretraining driver, saying when a step has begun."""

    began: asyncio.Event

    async def step(self, step: int):  # noqa: ANN201
        self.began.set()
        return await super().step(step)


async def run_job(nats_url: str, job_id: str, stop: asyncio.Event, began: asyncio.Event | None = None,
                  **settings) -> int:
    bus = await busmod.connect(nats_url, "ps")
    try:
        await bus.setup()
        job = JobConfig(job_id=job_id, preset="tiny", steps=3)
        driver = Watched(PsSettings(nats_url=nats_url, **settings), job, bus)
        driver.began = began or asyncio.Event()
        return await lifecycle.run(driver, bus, stop)
    finally:
        await bus.close()


async def test_a_step_that_times_out_ends_the_job_non_zero_with_nothing_committed(nats_url):
    code = await asyncio.wait_for(run_job(nats_url, "hung", asyncio.Event(), gemm_timeout_s=1.0), 120)
    assert code == EXIT_JOB_FAILED
    bus = await busmod.connect(nats_url, "check")
    try:
        assert await bus.kv_get(await bus.kv(STATE_BUCKET), "hung.head", StateHead) is None
    finally:
        await bus.close()


async def test_a_step_aborted_by_a_requested_stop_is_a_clean_stop(nats_url):
    stop, began = asyncio.Event(), asyncio.Event()
    job = asyncio.create_task(run_job(nats_url, "stopped", stop, began, gemm_timeout_s=600.0))
    await asyncio.wait_for(began.wait(), 120)  # its first step: no worker will ever answer its GEMMs
    stop.set()
    assert await asyncio.wait_for(job, 120) == EXIT_OK
