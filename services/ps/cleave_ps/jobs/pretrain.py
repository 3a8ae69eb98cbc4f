"""Pretraining on the PS (method `cleave`): the model and AdamW run here and every linear GEMM goes to the fleet
as tiles; a step is committed and reported once, with replicas (`replicas.py`) all-reducing gradients."""

from __future__ import annotations

import asyncio
import ctypes
import statistics
import time
from collections import deque

import structlog
import torch

from cleave import bus as busmod
from cleave.errors import (
    ConfigError,
    StepSpoiled,
)
from cleave.models import gemm_shapes
from cleave.runtime.faults import Faults
from cleave.runtime.memory import MAPPED_BYTES, peak_rss_bytes
from cleave.schemas import (
    COMPUTE_DTYPE_BYTES,
    PLAN_BUCKET,
    PLAN_KEY,
    REGISTRY_BUCKET,
    REPLICA_PLAN_KEY,
    SHAPES_KEY,
    SUBJECT_RESULTS,
    DeviceRecord,
    GemmSpec,
    JobShapes,
    Plan,
    StepMetrics,
    TileResult,
)
from cleave.train import preflight
from cleave.train.job import JobConfig
from cleave.train.schedule import lr_at
from cleave.train.trainer import Trainer
from cleave_ps.fleet.bridge import FleetGemm
from cleave_ps.fleet.dispatcher import Dispatcher
from cleave_ps.fleet.plans import PlanWatch
from cleave_ps.fleet.products import Products
from cleave_ps.jobs.lifecycle import Listen
from cleave_ps.jobs.replicas import ReplicaGroup, fingerprint
from cleave_ps.settings import PsSettings
from cleave_ps.state.persist import Progress

log = structlog.get_logger("ps")
OWN_TIME_WINDOW = 5  # steps over which the PS's own time per step is taken (median)
MAX_BUDGETS_READ = 10_000  # registry entries the preflight reads for the workers' memory budgets
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def return_freed_memory() -> None:
    """Have glibc give freed tensors back to the OS at once. Under its default, growing threshold (up to 32 MiB)
    the PS's many short-lived tensors of a few MB (input blocks, encoded frames, products) stayed in its heap
    when freed: gpt2-medium at 2 x 1024 held 1.2 GB more than it used at its peak. Elsewhere: nothing."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MAPPED_BYTES)
    except (OSError, AttributeError):  # not glibc
        log.info("malloc_threshold_unset")


async def worker_budgets(bus: busmod.Bus) -> list[int]:
    """The memory budgets (`memory_bytes`) the workers in the registry declared; empty when there are none
    or the registry cannot be read (logged: the preflight then assumes the worker's default)."""
    try:
        kv = await bus.kv(REGISTRY_BUCKET)
        keys = await bus.keys(kv)
        found = await asyncio.gather(*(bus.kv_get(kv, k, DeviceRecord) for k in keys[:MAX_BUDGETS_READ]))
    except Exception as e:  # the bus is away or the server does not answer
        log.info("worker_budgets_unread", reason=repr(e))
        return []
    return [f[0].profile.memory_bytes for f in found if f is not None]


def metrics_line(job: JobConfig, step: int, loss: float, dt: float, d: Dispatcher, before: dict,
                 val: float | None, resumed: bool, ps_own_s: float | None) -> StepMetrics:
    """This step's line; `ps_own_s` is the PS's usual time outside the GEMMs (None: not known yet)."""
    c = d.c
    recovery = tuple(c.recoveries[before["recoveries"]:])
    planned = c.planned_gemm_s - before["planned_gemm_s"] if c.unplanned == before["unplanned"] else None
    return StepMetrics(
        job=job.job_id, step=step, loss=loss, step_time_s=dt, workers=len(d.workers), tiles=c.tiles - before["tiles"],
        tiles_resent=c.resent - before["resent"], tiles_copied=c.copied - before["copied"],
        tiles_dropped=c.dropped - before["dropped"],
        rejected=c.rejected - before["rejected"], bytes_down=c.bytes_down - before["bytes_down"],
        bytes_up=c.bytes_up - before["bytes_up"], tokens=job.batch_size * job.seq, lr=lr_at(job, step), val_loss=val,
        recoveries=len(recovery), recovery=recovery, resumed=resumed, at=time.time(), peak_rss_bytes=peak_rss_bytes(),
        gemm_s=c.gemm_s - before["gemm_s"], predicted_gemm_s=planned, verify_cpu_s=c.verify_cpu_s - before["verify_cpu_s"],
        predicted_step_s=None if planned is None or ps_own_s is None else planned + ps_own_s,
    )


def snapshot_counters(d: Dispatcher) -> dict:
    c = d.c
    return dict(tiles=c.tiles, resent=c.resent, copied=c.copied, dropped=c.dropped, rejected=c.rejected, bytes_down=c.bytes_down,
                bytes_up=c.bytes_up, recoveries=len(c.recoveries), gemm_s=c.gemm_s,
                planned_gemm_s=c.planned_gemm_s, unplanned=c.unplanned, verify_cpu_s=c.verify_cpu_s)


def wire_bytes(s: PsSettings, job: JobConfig) -> int:
    """Bytes an input element of a tile takes on the wire."""
    return 4 if s.tile_dtype == "fp32" and job.precision == "fp32" else 2


def fit(s: PsSettings, job: JobConfig, workers: int = 1) -> tuple[JobConfig, preflight.Estimate, preflight.Memory]:
    """`job` with `recompute` decided, its estimate over `workers` and the memory this PS may use (what
    `preflight.check` then judges). It needs no NATS: `serve` checks it before dialling, so a PS that cannot fit
    says so at once, not once the bus answers; the workers' budgets from the registry are checked later."""
    if job.precision != "fp32" and s.tile_dtype != "fp32":
        raise ConfigError(f"CLEAVE_PS_TILE_DTYPE={s.tile_dtype} is the approximate mode of an fp32 job; "
                          f"with precision={job.precision} the tiles already travel in 2 bytes: unset it")
    memory = preflight.ps_memory(job, s.memory_bytes)
    job, est = preflight.resolve(job, memory, workers=workers, tile_bytes=wire_bytes(s, job), deferred=s.deferred_gemms,
                                 replicas=s.replicas, pool=s.product_pool_bytes)
    return job, est, memory


class Pretrain:
    """The pretraining driver of a job's lifecycle (`lifecycle.Driver`): the dispatcher deals every linear
    GEMM of the trainer's step to the fleet; with replicas, each trains its share of the batch and replica 0
    commits and reports for all."""

    def __init__(self, s: PsSettings, job: JobConfig, bus: busmod.Bus) -> None:
        return_freed_memory()
        self.s, self.job, self.bus = s, job, bus
        self.group = replica_group(s, job)
        # each replica deals under its own job name and epoch, fenced on its own (the workers keep one per job)
        self.wire_id = job.job_id if self.group is None else f"{job.job_id}-r{s.replica}"
        self.plan_key = PLAN_KEY if self.group is None else REPLICA_PLAN_KEY.format(replica=s.replica)
        fires = self.group is None or s.fail_replica in (-1, s.replica)
        self.faults = Faults(s.fail_at if fires else "", s.fault_dir, tag="ps" if self.group is None else self.wire_id)
        self.progress = Progress(bus, job, s, self.faults, fence_id=self.wire_id, writes_head=s.replica == 0)
        self.own_s: deque[float] = deque(maxlen=OWN_TIME_WINDOW)  # the PS's time outside GEMMs, recent steps
        self.dispatcher: Dispatcher | None = None
        self.first = 0

    async def join(self) -> None:
        """Join the replica group, if any: a replica of another job is refused here, before anything else."""
        if self.group is not None:
            await asyncio.to_thread(self.group.join, fingerprint(self.job.model_dump_json(), self.s.replicas))
            log.info("replica_group_joined", replica=self.s.replica, replicas=self.s.replicas, at=self.group.where)

    async def build(self, epoch: int, plans: PlanWatch) -> None:
        self.epoch = epoch
        self.dispatcher = Dispatcher(self.bus, self.wire_id, epoch, self.s)
        self.backend = FleetGemm(asyncio.get_running_loop(), self.dispatcher, self.faults)
        budgets = await worker_budgets(self.bus)
        await asyncio.to_thread(self.preflight, budgets)
        self.trainer = await asyncio.to_thread(Trainer, self.job, self.backend, None, self.group)
        if self.s.replica == 0:
            await self.describe_job()

    async def resume(self) -> int:
        """Replica 0 (or the only PS) restores and reports; the other replicas load the same head quietly,
        and the group checks that every replica starts from the same step."""
        model, opt = self.trainer.model, self.trainer.opt
        if self.s.replica == 0:
            first = await self.progress.resume(model, opt)
        else:
            head = await self.progress.persister.load(model, opt)
            first = 0 if head is None else head.step + 1
        await asyncio.to_thread(self.trainer.hold_optimizer_state)  # the peak from the first step (a fresh job)
        if self.s.replica == 0:  # (with AdamW's state now held: the checkpoint's full size)
            self.progress.check_room(model, opt)
        if self.group is not None:
            await asyncio.to_thread(self.group.agree, str(first), "the step to resume from")
        if not first:
            log.info("ps_started", job=self.job.job_id, preset=self.job.preset, steps=self.job.steps, epoch=self.epoch)
        self.first = first
        return first

    def listens(self, epoch: int) -> list[Listen]:
        d = self.dispatcher
        return [Listen(SUBJECT_RESULTS.format(job=self.wire_id, epoch=epoch, worker_id="*"), TileResult, d.on_result,
                       dict(max_bytes=self.s.max_result_bytes, pending_bytes=self.s.max_pending_bytes,
                            sender="worker_id", compressed=False, cap=d.result_limit))]

    async def on_plan(self, plan: Plan) -> None:
        await self.dispatcher.set_plan(plan)

    def preflight(self, budgets: list[int] | None = None) -> None:
        """Refuse a job whose estimated peak memory exceeds what this PS may use, or whose thinnest tile no
        registered worker can hold (ConfigError, exit 2); decide `recompute` if the job left it open."""
        budgets = budgets or []
        self.job, est, memory = fit(self.s, self.job, workers=max(1, len(budgets)))
        preflight.check(self.job, est, memory, budgets or preflight.DEFAULT_WORKER_MEMORY)
        self.dispatcher.products = Products(est.pool)  # (the pool of freed outputs in the memory the job leaves)
        if est.deferred[0] < self.s.deferred_gemms:  # the job fits only with fewer weight gradients deferred
            log.warning("deferred_gemms_lowered", job=self.job.job_id, deferred_gemms=est.deferred[0],
                        setting=self.s.deferred_gemms, ps_peak_gb=round(est.total / 1e9, 2))
            self.backend.deferred_gemms = est.deferred[0]
        log.info("preflight_passed", job=self.job.job_id, ps_peak_gb=round(est.total / 1e9, 2),
                 available_gb=round(memory.host / 1e9, 2), gpu_free_gb=memory.gpu and round(memory.gpu / 1e9, 2),
                 recompute=self.job.recompute, micro_batches=self.job.micro_batches, deferred_gemms=est.deferred[0],
                 head_chunks=est.layout.head_chunks, workers_declared=len(budgets),
                 free_outputs_gb=round(est.pool / 1e9, 2))

    async def describe_job(self) -> None:
        """Tell the scheduler this job's GEMM shapes, so that its plan fits them: elements travel in the job's
        precision both ways (a bf16 or fp16 job's results are rounded by their workers; the approximate
        `tile_dtype` mode's come back in float32, so it is planned at 4 bytes) and take float32 in memory."""
        specs = tuple(GemmSpec(name=g.name, m=g.m, n=g.n, k=g.k, count_per_step=g.count_per_step)
                      for g in gemm_shapes(self.trainer.cfg, self.job.batch_size // self.s.replicas, self.job.seq,
                                           self.trainer.layout))
        kv = await self.bus.kv(PLAN_BUCKET)
        await self.bus.kv_put(kv, SHAPES_KEY, JobShapes(job=self.job.job_id, gemms=specs,
                                                        dtype_bytes=4 if self.job.precision == "fp32" else 2,
                                                        memory_dtype_bytes=COMPUTE_DTYPE_BYTES, replicas=self.s.replicas))

    async def step(self, step: int) -> StepMetrics:
        d, resumed = self.dispatcher, self.first > 0
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
                 workers=m.workers, tiles=m.tiles, resent=m.tiles_resent, peak_rss_mb=round(m.peak_rss_bytes / 2**20, 1))
        if self.group is not None:  # the line reports the whole job (the log above: this replica's part)
            m = m.model_copy(update=await asyncio.to_thread(self.group.job_totals, m))
        return m

    async def commit(self, m: StepMetrics) -> None:
        if self.s.replica == 0:  # one replica commits (and reports); all hold the same state
            await self.progress.done(m, self.trainer.model, self.trainer.opt)

    async def finish(self, first: int) -> None:
        if self.s.replica == 0:
            await self.progress.finish(first)
        if self.group is not None:  # the others leave once replica 0 has committed the last step
            await asyncio.to_thread(self.group.barrier)

    def stopping(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.stopping = True  # a GEMM in flight raises StepAborted: the step is not applied

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


def replica_group(s: PsSettings, job: JobConfig) -> ReplicaGroup | None:
    """This PS's replica group (None: the only PS of its job); its share of the batch must be whole."""
    if s.replicas == 1:
        return None
    if job.batch_size % (s.replicas * job.micro_batches):
        raise ConfigError(f"replicas={s.replicas} needs a batch_size divisible by it times micro_batches "
                          f"(the job has batch_size {job.batch_size}, micro_batches {job.micro_batches})")
    backend = "nccl" if job.device != "cpu" and torch.cuda.is_available() else "gloo"
    return ReplicaGroup(s.replica, s.replicas, s.replica_addr, s.replica_port, s.replica_join_timeout_s,
                        s.replica_step_timeout_s, backend)
