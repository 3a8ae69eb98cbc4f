"""The scheduler service: keeps the device registry from heartbeats and publishes the plan on changes.

Nothing a worker sends can stop it: a heartbeat names its sender (its subject, which a per-worker credential
binds), a profile is finite and bounded where it is decoded, a profile that breaks the planner anyway is
dropped with the error logged (`worker_dropped`), a profile the PS sees its worker fall far short of is
corrected (`registry.Registry.observe`), and probes are answered only on the prober's own inbox (`probes`)."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from types import SimpleNamespace

import structlog

from cleave import auth, codec
from cleave import bus as busmod
from cleave.errors import PlanError, WireError
from cleave.runtime.lifecycle import run, wait_for_stop
from cleave.runtime.logs import configure
from cleave.schemas import (
    MAX_CONTROL_BYTES,
    MAX_PLAN_BYTES,
    MAX_PROBE_BYTES,
    PLAN_BUCKET,
    PLAN_KEY,
    REGISTRY_BUCKET,
    SHAPES_KEY,
    SUBJECT_HEARTBEAT_ALL,
    SUBJECT_OBSERVED_ALL,
    SUBJECT_PROBE_ALL,
    Event,
    Heartbeat,
    JobShapes,
    Observed,
    Plan,
    Probe,
)
from cleave_scheduler.outbox import Outbox
from cleave_scheduler.planning import warm, with_layouts_encoded
from cleave_scheduler.probes import ProbeDesk, prober, refusal
from cleave_scheduler.registry import Registry
from cleave_scheduler.replicas import ReplicaPlans
from cleave_scheduler.settings import SchedulerSettings

log = structlog.get_logger("scheduler")


PROCESS_MIN_DEVICES = 100  # fleets this large are planned in a process of their own
MAX_SUSPECTS = 8  # devices tried, one at a time, as the cause of a planner failure
MAX_OBSERVED_BYTES = 16 * 1024 * 1024  # a PS's report of what its workers delivered
SHARED_TOLD_S = 60.0  # a worker id two processes share is said at most this often


def planning_process() -> ProcessPoolExecutor:
    """Large fleets are planned in a process of their own: in a thread the plan would share the interpreter
    with the heartbeats of the fleet it plans."""
    return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))


class Scheduler:
    def __init__(self, s: SchedulerSettings, bus: busmod.Bus) -> None:
        self.s, self.bus = s, bus
        self.registry = Registry(s.liveness_s)
        self.written: dict[str, float] = {}  # worker id -> when its registry entry was last written
        self.told_shared: dict[str, float] = {}  # worker id -> when its sharing was last said
        self.changed = asyncio.Event()
        self.reasons: list[str] = []
        self.shapes: JobShapes | None = None
        self.planner: ProcessPoolExecutor | None = None  # started for the first large fleet
        self._warm = None
        self.replicas = ReplicaPlans()  # a job with several PS replicas: each one's part of the fleet
        self.good: set[tuple[str, object]] = set()  # (worker, profile) of the last fleet the planner laid out

    async def start(self) -> None:
        self.reg_kv = await self.bus.kv(REGISTRY_BUCKET)
        self.outbox = Outbox(self.bus, self.reg_kv)
        self.plan_kv = await self.bus.kv(PLAN_BUCKET)
        current = await self.bus.kv_get(self.plan_kv, PLAN_KEY, Plan, MAX_PLAN_BYTES)
        if current is not None:  # a restarted scheduler continues the version sequence
            self.registry.version = current[0].version

    def close(self) -> None:
        if self.planner is not None:
            self.planner.shutdown(cancel_futures=True)

    def _executor(self, devices: int) -> ProcessPoolExecutor | None:
        """The planning process for a fleet of `devices` (None: plan in a thread). It is started for the first
        fleet of `PROCESS_MIN_DEVICES`; its imports take seconds, and until they are done a thread plans."""
        if devices < PROCESS_MIN_DEVICES:
            return None
        if self.planner is None:
            self.planner = planning_process()
            self._warm = self.planner.submit(warm)
        return self.planner if self._warm.done() else None

    async def on_heartbeat(self, hb: Heartbeat, nbytes: int) -> None:
        """Record a heartbeat; what goes to JetStream is queued (the outbox), never awaited here."""
        now = time.time()
        joined = self.registry.heartbeat(hb, now)
        if joined is None:  # its profile broke the planner: dropped until it changes
            return
        both = self.registry.shared(hb, now)
        if both is not None and now - self.told_shared.get(hb.worker_id, 0.0) >= SHARED_TOLD_S:
            self.told_shared[hb.worker_id] = now
            started = [time.strftime("%H:%M:%S", time.localtime(t)) for t in both]
            log.warning("worker_id_shared", worker_id=hb.worker_id, started=started,
                        hint="two machines run with one worker id (one credential folder, or one --worker-id): "
                             "give each its own; the PS cannot tell their results apart")
            self.outbox.emit(Event(kind="worker_id_shared", at=now, worker_id=hb.worker_id,
                                   detail={"started_a": both[0], "started_b": both[1]}))
        if joined:
            log.info("worker_joined", worker_id=hb.worker_id, flops=f"{hb.profile.flops / 1e9:.1f}G")
            self.reasons.append("join")
            self.changed.set()
            self.outbox.emit(Event(kind="worker_joined", at=now, worker_id=hb.worker_id))
        if now - self.written.get(hb.worker_id, 0.0) >= self.s.registry_refresh_s:
            self.written[hb.worker_id] = now
            self.outbox.put(self.registry.devices[hb.worker_id])

    async def on_observed(self, report: Observed, nbytes: int) -> None:
        """A PS says what its workers delivered: a profile that claims far more is corrected, and re-planned."""
        for worker, old, new in self.registry.observe(report):
            log.warning("profile_corrected", worker_id=worker, job=report.job, slower_than_claimed=round(new, 2),
                        before=round(old, 2))
            self.outbox.put(self.registry.devices[worker])
            self.outbox.emit(Event(kind="profile_corrected", at=time.time(), worker_id=worker,
                                   detail={"factor": new, "before": old}))
            self.reasons.append("corrected")
            self.changed.set()

    def on_shapes(self, key: str, operation: str, value: bytes | None) -> None:
        """A PS described its job's GEMMs: plan them."""
        if not value:
            return
        try:
            self.shapes = codec.decode(value, JobShapes, MAX_CONTROL_BYTES)
        except WireError as e:
            self.bus.reject(e.reason, "shapes", str(e))
            return
        self.reasons.append("job")
        self.changed.set()

    async def sweep(self, stop: asyncio.Event) -> None:
        reconnects = self.bus.reconnects
        while not stop.is_set():
            now = time.time()
            if not self.bus.connected or self.bus.reconnects != reconnects:
                # heartbeats could not reach us: silence is not evidence, give everyone a fresh period
                reconnects = self.bus.reconnects
                self.registry.refresh(now)
                await wait_for_stop(stop, self.s.sweep_s)
                continue
            for w in self.registry.sweep(now):
                log.warning("worker_lost", worker_id=w, silent_s=self.s.liveness_s)
                self.reasons.append("leave")
                self.changed.set()
                self.written.pop(w, None)
                self.outbox.emit(Event(kind="worker_lost", at=now, worker_id=w, cause="heartbeat_timeout",
                                       detect_s=self.s.liveness_s))
                self.outbox.delete(w)
            await wait_for_stop(stop, self.s.sweep_s)

    async def make_plan(self, reason: str) -> Plan:
        """The plan for the registry's fleet now, with cost-aware blocks for the job's GEMMs (a job with
        several PS replicas has them in each replica's part instead: `ReplicaPlans`)."""
        plan = self.registry.plan(time.time(), self.s.tile_rows, self.s.tile_cols, reason, self.s.chunks)
        if self.shapes is not None and self.shapes.replicas > 1:
            return plan
        return await self.laid_out(plan)

    async def laid_out(self, plan: Plan) -> Plan:
        """`plan` with its blocks, made in the planning process; as it is where they cannot be planned
        (`PlanError`, e.g. no device can hold a block: the PS deals uniform tiles). Whatever else the planner
        raises, the scheduler goes on: the device that caused it is dropped (`_without_culprit`)."""
        if self.shapes is None or self.s.planner == "uniform" or not plan.workers:
            return plan  # nothing to lay out
        try:
            got = await self._lay_out(plan)
        except PlanError as e:
            log.warning("plan_not_cost_aware", error=str(e))
            return plan
        except Exception as e:  # a bug, or a profile no check caught: never the scheduler's end
            return await self._without_culprit(plan, e)
        self.good = {(w.worker_id, w.profile) for w in plan.workers}
        return got

    async def _lay_out(self, plan: Plan) -> Plan:
        args = (with_layouts_encoded, codec.encode(plan), codec.encode(self.shapes), self.s.planner,
                self.s.ps_bandwidth)
        try:
            got = await asyncio.get_running_loop().run_in_executor(self._executor(len(plan.workers)), *args)
        except BrokenProcessPool:  # it died (e.g. out of memory): a new one next time, a thread now
            log.warning("planning_process_died")
            self.planner.shutdown(wait=False)
            self.planner = None
            got = await asyncio.to_thread(*args)
        return codec.decode(got, Plan, MAX_PLAN_BYTES)

    async def _without_culprit(self, plan: Plan, error: Exception) -> Plan:
        """The planner failed on `plan`: try it without each device that is new or changed since it last
        succeeded; the first whose absence makes it succeed is dropped (logged with the error). Without one,
        the plan goes out without blocks (a uniform tile queue)."""
        suspects = [w.worker_id for w in plan.workers if (w.worker_id, w.profile) not in self.good][:MAX_SUSPECTS]
        for worker in suspects:
            trial = Plan.model_validate({**dict(plan), "workers": tuple(w for w in plan.workers if w.worker_id != worker)})
            try:
                got = await self._lay_out(trial) if trial.workers else trial
            except PlanError:
                got = trial
            except Exception:
                continue
            self.drop(worker, f"the planner failed with it: {error!r}")
            self.good = {(w.worker_id, w.profile) for w in trial.workers}
            return got
        log.error("plan_failed", error=repr(error), suspects=suspects)
        return plan

    def drop(self, worker: str, reason: str) -> None:
        """Leave `worker` out of the fleet until its profile changes; say why."""
        if self.registry.refuse(worker, reason) is None:
            return
        log.warning("worker_dropped", worker_id=worker, reason=reason[:500])
        self.written.pop(worker, None)
        self.outbox.delete(worker)
        self.outbox.emit(Event(kind="worker_dropped", at=time.time(), worker_id=worker, cause="bad_profile",
                               detail={"reason": reason[:500]}))

    async def publish_plans(self, stop: asyncio.Event) -> None:
        # listen for one liveness period first, so a restarted scheduler does not publish a partial fleet
        await wait_for_stop(stop, self.s.liveness_s)
        while not stop.is_set():
            waiter = asyncio.ensure_future(self.changed.wait())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            stopper.cancel()
            if stop.is_set():
                return
            self.changed.clear()
            reason = ",".join(sorted(set(self.reasons)))
            self.reasons.clear()
            started = time.perf_counter()
            try:
                plan = await self.make_plan(reason)
            except Exception as e:  # never the scheduler's end: the next change plans again
                log.error("plan_failed", error=repr(e))
                continue
            plan_s = time.perf_counter() - started
            try:
                await self.bus.kv_put(self.plan_kv, PLAN_KEY, plan)
                await self.replicas.publish(self.bus, self.plan_kv, plan, self.shapes, self.laid_out)
                log.info("plan_published", version=plan.version, workers=len(plan.workers), reason=reason,
                         planner=plan.planner, predicted_step_s=plan.predicted_step_s, plan_s=round(plan_s, 3))
                self.outbox.emit(Event(kind="plan_changed", at=plan.created_at, cause=reason,
                                       detail={"version": plan.version, "workers": len(plan.workers)}))
            except Exception as e:  # NATS down: try again when it is back
                log.warning("plan_not_published", error=repr(e))
                self.reasons.append(reason)
                self.changed.set()
                await asyncio.sleep(0.5)


async def serve(s: SchedulerSettings, stop: asyncio.Event) -> int:
    options, probe_options = auth.connect_options(s, "scheduler"), probe_credential(s)  # both checked first
    bus = await busmod.connect(s.nats_url, "cleave-scheduler", stop=stop, **options)
    if bus is None:  # stopped before NATS answered
        return 0
    await bus.setup()
    sched = Scheduler(s, bus)
    await sched.start()
    sub = await bus.subscribe(SUBJECT_HEARTBEAT_ALL, Heartbeat, sched.on_heartbeat, max_bytes=65536,
                              sender="worker_id")
    observed = await bus.subscribe(SUBJECT_OBSERVED_ALL, Observed, sched.on_observed, max_bytes=MAX_OBSERVED_BYTES)
    probe_bus = await probe_connection(s, probe_options, bus, stop)
    if probe_bus is None:  # stopped before its probe connection was made
        sched.close()
        await bus.close()
        return 0
    desk = ProbeDesk(probe_bus.max_payload, total_burst=s.echo_burst_bytes, total_rate=s.echo_bytes_per_s)

    async def on_probe(probe: Probe, subject: str) -> Probe | None:
        now = time.monotonic()
        echo = desk.answer(probe, prober(subject), now)
        if news := desk.news(now):  # (workers wait to measure their links: a flood, or settings too tight)
            log.warning("probe_echoes_held", **news, echo_burst_bytes=s.echo_burst_bytes,
                        echo_bytes_per_s=s.echo_bytes_per_s)
        return echo

    probes = await probe_bus.serve(SUBJECT_PROBE_ALL, Probe, on_probe, max_bytes=MAX_PROBE_BYTES + 1024,
                                   reply_ok=refusal, with_subject=True)
    log.info("scheduler_started", nats=s.nats_url, liveness_s=s.liveness_s, probes_apart=probe_bus is not bus,
             chunks=s.chunks)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(sched.sweep(stop))
        tg.create_task(sched.outbox.run(stop))
        tg.create_task(sched.publish_plans(stop))
        tg.create_task(bus.watch(PLAN_BUCKET, SHAPES_KEY, sched.on_shapes, stop))
    for s_ in (sub, observed, probes):
        await s_.unsubscribe()
    sched.close()
    if probe_bus is not bus:
        await probe_bus.close()
    await bus.close()
    return 0


def probe_credential(s: SchedulerSettings) -> dict | None:
    """The connect options of the probe credential (`probe_nkey_seed`); None when there is none. A malformed
    seed is refused by its own name before anything is dialled."""
    seed = s.probe_nkey_seed.get_secret_value()
    if not seed:
        return None
    auth.user_seed("CLEAVE_SCHEDULER_PROBE_NKEY_SEED", seed)
    return auth.connect_options(SimpleNamespace(nats_nkey_seed=seed, nats_tls_ca=s.nats_tls_ca), "scheduler")


async def probe_connection(s: SchedulerSettings, options: dict | None, bus: busmod.Bus,
                           stop: asyncio.Event) -> busmod.Bus | None:
    """The connection probes are answered on: with its own credential (`options`, which may publish only to
    the workers' inboxes) when there is one, else the scheduler's own."""
    if options is not None:
        return await busmod.connect(s.nats_url, "cleave-scheduler-probe", stop=stop, **options)
    if s.nats_nkey_seed.get_secret_value():
        log.warning("probes_on_main_credential", hint="set CLEAVE_SCHEDULER_PROBE_NKEY_SEED from the scheduler.env "
                    "that `cleave auth init` writes: its own credential may not answer probes")
    return bus


def main(settings: SchedulerSettings | None = None) -> int:
    settings = settings or SchedulerSettings()
    configure("scheduler")
    return run(lambda stop: serve(settings, stop))
