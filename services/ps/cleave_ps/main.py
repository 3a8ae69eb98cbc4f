"""The parameter-server service: runs the model and AdamW, deals every linear GEMM to the fleet as tiles."""

from __future__ import annotations

import asyncio
import time

import structlog
import torch

from cleave import bus as busmod
from cleave.errors import StepAborted
from cleave.job import JobConfig
from cleave.lifecycle import run
from cleave.logs import configure
from cleave.metrics_file import MetricsFile
from cleave.schemas import PLAN_BUCKET, PLAN_KEY, SUBJECT_RESULTS, Plan, StepMetrics, TileResult
from cleave.training import Trainer
from cleave_ps.dispatcher import Dispatcher
from cleave_ps.settings import PsSettings

log = structlog.get_logger("ps")


class FleetGemm:
    """The GEMM backend of the PS's linear layers: blocks the training thread while the fleet computes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, dispatcher: Dispatcher) -> None:
        self.loop, self.dispatcher = loop, dispatcher
        self.step, self.op = 0, 0

    def begin(self, step: int) -> None:
        self.step, self.op = step, 0
        self.dispatcher.new_step()

    def gemm(self, a: torch.Tensor, bt: torch.Tensor, name: str) -> torch.Tensor:
        self.op += 1
        fut = asyncio.run_coroutine_threadsafe(self.dispatcher.gemm(a, bt, self.step, self.op, name), self.loop)
        return fut.result()


async def watch_plans(bus: busmod.Bus, dispatcher: Dispatcher, stop: asyncio.Event) -> None:
    """Apply every plan the scheduler publishes (the current one first)."""
    kv = await bus.kv(PLAN_BUCKET)
    watcher = await kv.watch(PLAN_KEY)
    while not stop.is_set():
        try:
            entry = await watcher.updates(timeout=0.5)
        except TimeoutError:
            continue
        if entry is None or entry.value is None:
            continue
        try:
            plan = busmod.codec.decode(entry.value, Plan)
        except busmod.WireError as e:
            bus.reject(e.reason, "plan", str(e))
            continue
        await dispatcher.set_plan(plan)
    await watcher.stop()


def metrics_line(job: JobConfig, step: int, loss: float, dt: float, d: Dispatcher, before: dict, val: float | None) -> StepMetrics:
    c = d.c
    return StepMetrics(
        job=job.job_id, step=step, loss=loss, step_time_s=dt, workers=len(d.workers), tiles=c.tiles - before["tiles"],
        tiles_resent=c.resent - before["resent"], tiles_dropped=c.dropped - before["dropped"],
        rejected=c.rejected - before["rejected"], bytes_down=c.bytes_down - before["bytes_down"],
        bytes_up=c.bytes_up - before["bytes_up"], tokens=job.batch_size * job.seq, lr=job.lr, val_loss=val,
        recoveries=len(c.recoveries) - before["recoveries"], at=time.time(),
    )


def snapshot(d: Dispatcher) -> dict:
    c = d.c
    return dict(tiles=c.tiles, resent=c.resent, dropped=c.dropped, rejected=c.rejected,
                bytes_down=c.bytes_down, bytes_up=c.bytes_up, recoveries=len(c.recoveries))


async def train(s: PsSettings, job: JobConfig, bus: busmod.Bus, stop: asyncio.Event) -> int:
    epoch = time.time_ns() // 1_000_000
    dispatcher = Dispatcher(bus, job.job_id, epoch, s)
    backend = FleetGemm(asyncio.get_running_loop(), dispatcher)
    trainer = await asyncio.to_thread(Trainer, job, backend)
    sub = await bus.subscribe(SUBJECT_RESULTS.format(job=job.job_id, epoch=epoch), TileResult, dispatcher.on_result,
                              max_bytes=s.max_result_bytes)
    out = MetricsFile(s.metrics_out)
    log.info("ps_started", job=job.job_id, preset=job.preset, steps=job.steps, epoch=epoch)
    async def abort_on_stop() -> None:
        await stop.wait()
        dispatcher.stopping = True  # a GEMM in flight raises StepAborted: the step is not applied

    async with asyncio.TaskGroup() as tg:
        watcher = tg.create_task(watch_plans(bus, dispatcher, stop))
        tg.create_task(abort_on_stop())
        try:
            for step in range(job.steps):
                if stop.is_set():
                    break
                before, t0 = snapshot(dispatcher), time.perf_counter()
                backend.begin(step)
                loss = await asyncio.to_thread(trainer.step, step)
                val = None
                if job.val_every and (step + 1) % job.val_every == 0:
                    backend.begin(step)
                    val = await asyncio.to_thread(trainer.val_loss, step)
                m = metrics_line(job, step, loss, time.perf_counter() - t0, dispatcher, before, val)
                for ev in dispatcher.c.recoveries[before["recoveries"]:]:
                    await bus.emit(ev)
                await bus.emit(m)
                await asyncio.to_thread(out.write, m)
                log.info("step_done", step=step, loss=round(loss, 5), step_time_s=round(m.step_time_s, 3),
                         workers=m.workers, tiles=m.tiles, resent=m.tiles_resent)
        except StepAborted as e:
            log.warning("step_aborted", reason=str(e))
        finally:
            dispatcher.stopping = True
            stop.set()
            watcher.cancel()
    await sub.unsubscribe()
    return 0


async def serve(s: PsSettings, stop: asyncio.Event) -> int:
    job = JobConfig.load(s.job_file) if s.job_file else JobConfig()
    if s.threads:
        torch.set_num_threads(s.threads)
    bus = await busmod.connect(s.nats_url, "ps")
    await bus.setup()
    try:
        return await train(s, job, bus, stop)
    finally:
        await bus.close()


def main(settings: PsSettings | None = None) -> int:
    settings = settings or PsSettings()
    configure("ps")
    return run(lambda stop: serve(settings, stop))
