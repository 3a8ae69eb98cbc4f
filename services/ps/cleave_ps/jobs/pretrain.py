"""Pretraining on the PS (method `cleave`): the model and AdamW run here and every linear GEMM goes to the fleet
as tiles; a step is committed and reported once, with replicas (`replicas.py`) all-reducing gradients."""

from __future__ import annotations

import asyncio
import resource
import statistics
import time
from collections import deque

import structlog
import torch

from cleave import bus as busmod
from cleave.errors import (
    EXIT_FENCED,
    EXIT_GROUP_LOST,
    ConfigError,
    Fenced,
    ReplicaLost,
    StepAborted,
    StepSpoiled,
)
from cleave.models import gemm_shapes
from cleave.runtime.faults import Faults
from cleave.schemas import (
    COMPUTE_DTYPE_BYTES,
    PLAN_BUCKET,
    PLAN_KEY,
    REPLICA_PLAN_KEY,
    SHAPES_KEY,
    SUBJECT_RESULTS,
    GemmSpec,
    JobShapes,
    StepMetrics,
    TileResult,
)
from cleave.train import preflight
from cleave.train.job import JobConfig
from cleave.train.schedule import lr_at
from cleave.train.trainer import Trainer
from cleave_ps.fleet.bridge import FleetGemm
from cleave_ps.fleet.dispatcher import Dispatcher
from cleave_ps.fleet.plans import watch_plans
from cleave_ps.jobs.replicas import ReplicaGroup, fingerprint
from cleave_ps.settings import PsSettings
from cleave_ps.state.persist import Progress

log = structlog.get_logger("ps")
OWN_TIME_WINDOW = 5  # steps over which the PS's own time per step is taken (median)


def metrics_line(job: JobConfig, step: int, loss: float, dt: float, d: Dispatcher, before: dict,
                 val: float | None, resumed: bool, ps_own_s: float | None) -> StepMetrics:
    """This step's line; `ps_own_s` is the PS's usual time outside the GEMMs (None: not known yet)."""
    c = d.c
    recovery = tuple(c.recoveries[before["recoveries"]:])
    planned = c.planned_gemm_s - before["planned_gemm_s"] if c.unplanned == before["unplanned"] else None
    return StepMetrics(
        job=job.job_id, step=step, loss=loss, step_time_s=dt, workers=len(d.workers), tiles=c.tiles - before["tiles"],
        tiles_resent=c.resent - before["resent"], tiles_copied=c.speculated - before["speculated"],
        tiles_dropped=c.dropped - before["dropped"],
        rejected=c.rejected - before["rejected"], bytes_down=c.bytes_down - before["bytes_down"],
        bytes_up=c.bytes_up - before["bytes_up"], tokens=job.batch_size * job.seq, lr=lr_at(job, step), val_loss=val,
        recoveries=len(recovery), recovery=recovery, resumed=resumed, at=time.time(),
        gemm_s=c.gemm_s - before["gemm_s"], predicted_gemm_s=planned,
        predicted_step_s=None if planned is None or ps_own_s is None else planned + ps_own_s,
    )


def snapshot_counters(d: Dispatcher) -> dict:
    c = d.c
    return dict(tiles=c.tiles, resent=c.resent, speculated=c.speculated, dropped=c.dropped, rejected=c.rejected, bytes_down=c.bytes_down,
                bytes_up=c.bytes_up, recoveries=len(c.recoveries), gemm_s=c.gemm_s,
                planned_gemm_s=c.planned_gemm_s, unplanned=c.unplanned)


class Job:
    """One training job on the PS: resume from persisted state, run steps, commit, report each step once."""

    def __init__(self, s: PsSettings, job: JobConfig, bus: busmod.Bus, stop: asyncio.Event) -> None:
        self.s, self.job, self.bus, self.stop = s, job, bus, stop
        self.group = replica_group(s, job)
        # each replica deals under its own job name and epoch, fenced on its own (the workers keep one per job)
        self.wire_id = job.job_id if self.group is None else f"{job.job_id}-r{s.replica}"
        fires = self.group is None or s.fail_replica in (-1, s.replica)
        self.faults = Faults(s.fail_at if fires else "", s.fault_dir, tag="ps" if self.group is None else self.wire_id)
        self.progress = Progress(bus, job, s, self.faults, fence_id=self.wire_id)
        self.own_s: deque[float] = deque(maxlen=OWN_TIME_WINDOW)  # the PS's time outside GEMMs, recent steps

    async def start(self) -> int:
        """Join the replica group (if any), claim an epoch, build the model, restore the last committed
        state; returns the first step to run."""
        if self.group is not None:  # before anything else: a replica of another job is refused here
            await asyncio.to_thread(self.group.join, fingerprint(self.job.model_dump_json(), self.s.replicas))
            log.info("replica_group_joined", replica=self.s.replica, replicas=self.s.replicas, at=self.group.where)
        epoch = await self.progress.open()
        self.dispatcher = Dispatcher(self.bus, self.wire_id, epoch, self.s)
        self.backend = FleetGemm(asyncio.get_running_loop(), self.dispatcher, self.faults)
        await asyncio.to_thread(self.preflight)
        self.trainer = await asyncio.to_thread(Trainer, self.job, self.backend, None, self.group)
        if self.s.replica == 0:
            await self.describe_job()
        first = await self.resume()
        if not first:
            log.info("ps_started", job=self.job.job_id, preset=self.job.preset, steps=self.job.steps, epoch=epoch)
        return first

    async def resume(self) -> int:
        """Replica 0 (or the only PS) restores and reports; the other replicas load the same head quietly,
        and the group checks that every replica starts from the same step."""
        model, opt = self.trainer.model, self.trainer.opt
        if self.s.replica == 0:
            first = await self.progress.resume(model, opt)
        else:
            head = await self.progress.persister.load(model, opt)
            first = 0 if head is None else head.step + 1
        if self.group is not None:
            await asyncio.to_thread(self.group.agree, str(first), "the step to resume from")
        return first

    def preflight(self) -> None:
        """Refuse a job whose estimated peak memory exceeds what this PS may use (ConfigError, exit 2)."""
        if self.job.precision != "fp32" and self.s.tile_dtype != "fp32":
            raise ConfigError(f"CLEAVE_PS_TILE_DTYPE={self.s.tile_dtype} is the approximate mode of an fp32 job; "
                              f"with precision={self.job.precision} the tiles already travel in 2 bytes: unset it")
        est = preflight.estimate(self.job, workers=1, tile_bytes=self.wire_bytes, deferred=self.s.deferred_gemms)
        memory = self.s.memory_bytes or preflight.available_memory()
        preflight.check(self.job, est, memory)
        log.info("preflight_passed", job=self.job.job_id, ps_peak_gb=round(est.total / 1e9, 2),
                 available_gb=round(memory / 1e9, 2))

    @property
    def wire_bytes(self) -> int:
        """Bytes an input element of a tile takes on the wire."""
        return 4 if self.s.tile_dtype == "fp32" and self.job.precision == "fp32" else 2

    async def describe_job(self) -> None:
        """Tell the scheduler this job's GEMM shapes, so that its plan fits them: elements travel in the job's
        precision both ways (a bf16 or fp16 job's results are rounded by their workers; the approximate
        `tile_dtype` mode's come back in float32, so it is planned at 4 bytes) and take float32 in memory."""
        specs = tuple(GemmSpec(name=g.name, m=g.m, n=g.n, k=g.k, count_per_step=g.count_per_step)
                      for g in gemm_shapes(self.trainer.cfg, self.job.batch_size // self.s.replicas, self.job.seq))
        kv = await self.bus.kv(PLAN_BUCKET)
        await self.bus.kv_put(kv, SHAPES_KEY, JobShapes(job=self.job.job_id, gemms=specs,
                                                        dtype_bytes=4 if self.job.precision == "fp32" else 2,
                                                        memory_dtype_bytes=COMPUTE_DTYPE_BYTES, replicas=self.s.replicas))

    async def run_step(self, step: int, resumed: bool) -> None:
        d = self.dispatcher
        before, t0 = snapshot_counters(d), time.perf_counter()
        while True:
            self.backend.begin(step)
            try:
                loss = await asyncio.to_thread(self.trainer.step, step)
                break
            except StepSpoiled as e:  # nothing was applied: run the step again without the liar
                log.warning("step_redone", step=step, reason=str(e))
        val = None
        if self.job.val_every and (step + 1) % self.job.val_every == 0:
            self.backend.begin(step)
            val = await asyncio.to_thread(self.trainer.val_loss, step)
        own = statistics.median(self.own_s) if self.own_s else None
        m = metrics_line(self.job, step, loss, time.perf_counter() - t0, d, before, val, resumed, own)
        if self.group is not None:
            wait, allreduce = self.trainer.last_sync
            m = m.model_copy(update={"replica_wait_s": wait, "allreduce_s": allreduce})
        self.own_s.append(m.step_time_s - m.gemm_s)
        log.info("step_done", step=step, loss=round(loss, 5), step_time_s=round(m.step_time_s, 3),
                 workers=m.workers, tiles=m.tiles, resent=m.tiles_resent,
                 peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
        if self.group is not None:  # the line reports the whole job (the log above: this replica's part)
            m = m.model_copy(update=await asyncio.to_thread(self.group.job_totals, m))
        if self.s.replica == 0:  # one replica commits (and reports); all hold the same state
            await self.progress.done(m, self.trainer.model, self.trainer.opt)


def replica_group(s: PsSettings, job: JobConfig) -> ReplicaGroup | None:
    """This PS's replica group (None: the only PS of its job); its share of the batch must be whole."""
    if s.replicas == 1:
        return None
    if job.batch_size % s.replicas:
        raise ConfigError(f"replicas={s.replicas} needs a batch_size divisible by it (the job has {job.batch_size})")
    backend = "nccl" if job.device != "cpu" and torch.cuda.is_available() else "gloo"
    return ReplicaGroup(s.replica, s.replicas, s.replica_addr, s.replica_port, s.replica_join_timeout_s,
                        s.replica_step_timeout_s, backend)


async def train(s: PsSettings, job: JobConfig, bus: busmod.Bus, stop: asyncio.Event) -> int:
    run = Job(s, job, bus, stop)
    try:
        return await train_job(run, s, job, bus, stop)
    except ReplicaLost as e:
        log.warning("replica_group_lost", replica=s.replica, reason=str(e))
        return EXIT_GROUP_LOST
    finally:
        if run.group is not None:
            run.group.close()


async def train_job(run: Job, s: PsSettings, job: JobConfig, bus: busmod.Bus, stop: asyncio.Event) -> int:
    first = await run.start()
    d = run.dispatcher
    sub = await bus.subscribe(SUBJECT_RESULTS.format(job=run.wire_id, epoch=d.epoch, worker_id="*"), TileResult,
                              d.on_result, max_bytes=s.max_result_bytes, pending_bytes=s.max_pending_bytes,
                              sender="worker_id")

    async def abort_on_stop() -> None:
        await stop.wait()
        d.stopping = True  # a GEMM in flight raises StepAborted: the step is not applied

    code = 0
    async with asyncio.TaskGroup() as tg:
        key = PLAN_KEY if run.group is None else REPLICA_PLAN_KEY.format(replica=s.replica)
        watcher = tg.create_task(watch_plans(bus, d, stop, key))
        tg.create_task(abort_on_stop())
        try:
            for step in range(first, job.steps):
                if stop.is_set():
                    break
                await run.run_step(step, resumed=first > 0)
            else:  # every step ran (none, when a restarted PS finds the job already done)
                if s.replica == 0:
                    await run.progress.finish(first)
                if run.group is not None:  # the others leave once replica 0 has committed the last step
                    await asyncio.to_thread(run.group.barrier)
        except StepAborted as e:
            log.warning("step_aborted", reason=str(e))
        except Fenced as e:
            log.warning("ps_fenced", reason=str(e))
            code = EXIT_FENCED
        except ReplicaLost as e:  # another replica died mid-step: nothing applied, the group re-forms
            log.warning("replica_group_lost", replica=s.replica, reason=str(e))
            code = EXIT_GROUP_LOST
        finally:
            d.stopping = True
            stop.set()
            watcher.cancel()
    await sub.unsubscribe()
    return code
