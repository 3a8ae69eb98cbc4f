"""The worker service: dial out to NATS, register, heartbeat, take tiles, compute them, return blocks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterator

import structlog
import torch

from cleave import auth, codec
from cleave import bus as busmod
from cleave.errors import WireError
from cleave.gemm.dealer import JOINS_KEPT
from cleave.plan.profile import Pacer, parse_profile
from cleave.runtime.faults import Faults
from cleave.runtime.lifecycle import run, wait_for_stop
from cleave.runtime.logs import configure
from cleave.schemas import (
    MAX_LINKCHECK_BYTES,
    SUBJECT_CONTROL,
    SUBJECT_FANOUT,
    SUBJECT_HEARTBEAT,
    SUBJECT_LINKCHECK,
    SUBJECT_ROUNDCAST_ALL,
    SUBJECT_ROUNDS,
    SUBJECT_SPLIT,
    SUBJECT_TILES,
    BlockPush,
    DeviceProfile,
    FanoutAck,
    FanoutJoin,
    Heartbeat,
    LinkCheck,
    LinkCheckAck,
    RoundTask,
    RoundUpdate,
    SplitReply,
    SplitTask,
    TileTask,
)
from cleave_worker.core import (
    BlockCache,
    check_inputs,
    compute,
    leaves,
    measure_flops,
    reply_to,
)
from cleave_worker.local_rounds import RoundRunner
from cleave_worker.probe import measure_links
from cleave_worker.settings import WorkerSettings
from cleave_worker.split_client import SplitRunner

DEFAULT_PROBE_RETRY_S = 1.0  # until its links are measured a worker does not join (it is planned not at all)
DEFAULT_FANOUT_WAIT_S = 2.0  # how long a tile waits for a block its fan-out group is being sent


class Worker:
    def __init__(self, settings: WorkerSettings, bus: busmod.Bus, profile: DeviceProfile,
                 hb_bus: busmod.Bus | None = None, probe_bus: busmod.Bus | None = None) -> None:
        self.s, self.bus, self.profile = settings, bus, profile
        self.hb_bus = hb_bus or bus  # heartbeats on their own connection: never queued behind results or probes
        self.probe_bus = probe_bus or bus  # probes on theirs: a re-probe's megabytes never queue ahead of results
        self.cache = BlockCache(settings.cache_bytes)
        self.started_at = time.time()
        self.tiles_done = 0
        self.computing = 0  # tiles and rounds computing now (a FLOPS re-measurement beside them is discarded)
        self.computations = 0  # ... and begun so far
        self.busy_s = 0.0
        self.epochs: dict[str, int] = {}  # job -> newest PS epoch seen; older PSs are fenced off
        self.faults = Faults(settings.fail_at, settings.fault_dir, tag=settings.worker_id)
        self.pacer = Pacer(profile) if profile.declared else None
        self.rounds = RoundRunner(settings.worker_id, settings.data)
        self.split = SplitRunner(settings.worker_id, str(settings.data) if settings.data else None)
        self.log = structlog.get_logger("worker").bind(worker_id=settings.worker_id)
        self.groups: dict[str, object] = {}  # fan-out subject -> its subscription
        self.joins: dict[str, deque[tuple[str, ...]]] = {}  # job -> subjects of its latest joins (JOINS_KEPT)
        self.arrivals: dict[str, asyncio.Event] = {}  # fan-out blocks a tile waits for
        self.fenced_before: dict[str, tuple[int, float]] = {}  # job -> (epoch, PS time) of its last link check
        self.stale = 0  # tiles dropped because they were sent before this worker's last link check
        self.outbox: asyncio.Queue = asyncio.Queue()  # (task, result, due) to upload; None: stop

    async def on_join(self, join: FanoutJoin) -> FanoutAck:
        """The PS's fan-out groups for this worker: subscribe to them, leave the job's others."""
        if join.epoch < self.epochs.get(join.job, 0):
            return FanoutAck(worker_id=self.s.worker_id, error=f"epoch {join.epoch} is fenced off")
        self.epochs[join.job] = join.epoch
        prefix = SUBJECT_FANOUT.split("{epoch}")[0].format(job=join.job)  # this job's fan-out subjects
        joins = self.joins.setdefault(join.job, deque(maxlen=JOINS_KEPT))
        joins.append(join.subjects)
        keep = set().union(*joins)  # a GEMM in flight when the plan changed goes on with its groups
        try:
            for subject in [s for s in self.groups if s.startswith(prefix) and s not in keep]:
                await self.groups.pop(subject).unsubscribe()
            for subject in join.subjects:
                if subject not in self.groups:
                    self.groups[subject] = await self.bus.subscribe(subject, BlockPush, self.on_push)
            await self.bus.nc.flush(timeout=busmod.DEFAULT_TIMEOUT_S)  # subscribed at the server before we say so
        except Exception as e:  # the PS then sends this worker's shared blocks with its tiles
            return FanoutAck(worker_id=self.s.worker_id, error=repr(e)[:500])
        return FanoutAck(worker_id=self.s.worker_id, joined=tuple(s for s in join.subjects if s in self.groups))

    async def on_check(self, check: LinkCheck) -> LinkCheckAck:
        """The PS proves this worker's downlink (it came back) before dealing it tiles: answer at once."""
        if check.job and check.epoch >= self.epochs.get(check.job, 0):
            self.fenced_before[check.job] = (check.epoch, check.sent_at)
        return LinkCheckAck(worker_id=self.s.worker_id)

    async def on_push(self, push: BlockPush, nbytes: int) -> None:
        """A shared input block published to one of this worker's groups: cache it for the tiles that need it."""
        if push.epoch < self.epochs.get(push.job, 0) or push.block.tensor is None:
            return
        self.cache.resolve(push.block)
        waiting = self.arrivals.pop(push.block.id, None)
        if waiting is not None:
            waiting.set()

    async def _arrived(self, ref) -> None:  # noqa: ANN001
        """Wait (a little) for a block that comes on a fan-out subject and is not here yet."""
        if not ref.fanout or ref.tensor is not None or self.cache.get(ref.id) is not None:
            return
        event = self.arrivals.setdefault(ref.id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), DEFAULT_FANOUT_WAIT_S)
        except TimeoutError:
            self.arrivals.pop(ref.id, None)  # the tile answers that it is missing; the PS sends it direct

    async def on_tile(self, task: TileTask, nbytes: int) -> None:
        self.faults.hit("tile", task.step)
        if task.epoch < self.epochs.get(task.job, 0):
            self.log.warning("tile_fenced", job=task.job, epoch=task.epoch, newest=self.epochs[task.job])
            return
        self.epochs[task.job] = task.epoch
        fence = self.fenced_before.get(task.job)
        if fence is not None and fence[0] == task.epoch and task.sent_at < fence[1]:
            self.stale += 1  # sent before this worker left; the PS gave it to another worker then
            self.log.debug("tile_stale", step=task.step, op=task.op, tile=task.tile, dropped=self.stale)
            return
        refs = (*leaves(task.a), *leaves(task.b))
        await asyncio.gather(*(self._arrived(ref) for ref in refs))
        a, bt = self.cache.resolve(task.a), self.cache.resolve(task.b)
        missing = tuple(leaf.id for ref, t in ((task.a, a), (task.b, bt)) if t is None for leaf in leaves(ref)
                        if leaf.tensor is None and self.cache.get(leaf.id) is None)
        if missing:
            result = reply_to(task, self.s.worker_id, missing=missing)
        elif why := check_inputs(a, bt, self.profile.memory_bytes):
            self.log.warning("tile_refused", reason=why, step=task.step, op=task.op, tile=task.tile)
            result = reply_to(task, self.s.worker_id, error=why)
        else:
            with self._computing():
                result = await asyncio.to_thread(compute, task, a, bt, self.s.worker_id, self.s.corrupt)
            self.tiles_done += 1
            self.busy_s += result.compute_s
        due = 0.0
        if self.pacer is not None and result.out is not None:  # behave like the declared device: answer when
            flops = 2 * a.shape[0] * bt.shape[0] * a.shape[1]  # it would have (its uplink is the uploader's)
            due = self.pacer.finish_at(min(task.sent_at, time.time()), nbytes, len(result.out.data), flops)
        self.outbox.put_nowait((task, result, due))  # uploaded by `uploads` while the next tile computes

    async def uploads(self) -> None:
        """Send results in the order they were computed, from a task of their own: a result waiting for a
        slow uplink never holds up the next tile's compute (the streamed device of the cost model)."""
        while True:
            item = await self.outbox.get()
            if item is None:  # stopping: what was queued before has been sent
                return
            task, result, due = item
            if due:
                await asyncio.sleep(max(0.0, due - time.time()))
            try:
                await self.bus.publish(task.reply, result)
            except WireError as e:  # e.g. an output block over the limits: say so, the PS gives the tile away
                self.log.warning("result_not_sent", error=str(e), step=task.step, op=task.op, tile=task.tile)
            except Exception as e:  # disconnected: the PS's deadline gives the tile to another worker
                self.log.warning("result_not_sent", error=repr(e), step=task.step, op=task.op, tile=task.tile)

    async def close_outbox(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.outbox.put_nowait(None)

    @contextlib.contextmanager
    def _computing(self) -> Iterator[None]:
        self.computing += 1
        self.computations += 1
        try:
            yield
        finally:
            self.computing -= 1

    async def reprobe(self, stop: asyncio.Event) -> None:
        """Measure the links and the FLOPS again now and then: they change under a real device. A failed
        measurement keeps the last profile (the failure is logged); so does a FLOPS measurement that shared
        the device with this worker's own tiles or rounds (it would under-report what the device has: the
        dealer's round trips tell a busy worker's pace anyway)."""
        while not await wait_for_stop(stop, self.s.probe_every_s):
            try:
                before = (self.computing, self.computations)
                flops = await asyncio.to_thread(measure_flops)
                if before != (0, self.computations) or self.computing:
                    self.log.info("flops_kept", reason="computed tiles meanwhile", flops=self.profile.flops,
                                  measured=flops)
                    flops = self.profile.flops
                self.profile = await measured_profile(self.s, self.probe_bus, flops)
            except Exception as e:  # e.g. the scheduler restarting: measure again next time
                self.log.warning("reprobe_failed", error=repr(e))

    async def on_round(self, task: RoundTask, nbytes: int) -> None:
        """A data-parallel round (diloco, fedavg): train locally off the event loop, send the update."""
        self.faults.hit("round", task.round)
        arrived = time.time()
        try:
            with self._computing():
                update = await asyncio.to_thread(self.rounds.run, task)
        except Exception as e:  # a bad task spoils this round's update, not the worker
            self.log.warning("round_failed", job=task.job, round=task.round, error=repr(e))
            update = RoundUpdate(job=task.job, epoch=task.epoch, round=task.round, worker_id=self.s.worker_id,
                                 error=repr(e)[:500])
        else:
            if self.pacer is not None:  # behave like the declared device: answer when it would have
                up = len(await asyncio.to_thread(codec.encode, update))
                done = self.pacer.finish_at(arrived, nbytes, up, self.rounds.flops(task))
                await asyncio.sleep(max(0.0, done - time.time()))
        await self.bus.publish(task.reply.replace("{worker_id}", self.s.worker_id), update)  # its own subject

    async def on_roundcast(self, task: RoundTask, nbytes: int) -> None:
        """A round published once for all its workers: take part if this worker is named in it."""
        shard = task.shards.get(self.s.worker_id)
        if shard is not None:
            await self.on_round(task.model_copy(update={"shard": shard, "shards": {}}), nbytes)

    async def on_split(self, task: SplitTask, nbytes: int) -> None:
        """Split learning: this worker is the client; run its half of the step off the event loop."""
        self.faults.hit("split", task.step)
        try:
            reply = await asyncio.to_thread(self.split.run, task)
        except Exception as e:  # the PS hears why, and the step is not half-applied silently
            self.log.warning("split_step_failed", job=task.job, step=task.step, phase=task.phase, error=repr(e))
            reply = SplitReply(job=task.job, epoch=task.epoch, step=task.step, phase=task.phase,
                               worker_id=self.s.worker_id, error=repr(e)[:500])
        await self.bus.publish(task.reply, reply)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.s.worker_id, profile=self.profile, sent_at=time.time(), started_at=self.started_at,
            cache_bytes=self.s.cache_bytes, tiles_done=self.tiles_done, busy_s=self.busy_s,
        )

    async def heartbeats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.hb_bus.publish(SUBJECT_HEARTBEAT.format(worker_id=self.s.worker_id), self.heartbeat())
            except Exception as e:  # disconnected: nats-py reconnects; keep beating
                self.log.warning("heartbeat_failed", error=repr(e))
            await wait_for_stop(stop, self.s.heartbeat_s)


async def measured_profile(s: WorkerSettings, bus: busmod.Bus, flops: float) -> DeviceProfile:
    """This device as it is: GEMM FLOPS, and its links to the hub as the probes prove them (ProbeFailed
    when the scheduler does not answer)."""
    links = await measure_links(bus)
    # bounded: a probe timed out, the link is at most this fast, and that is what we report
    structlog.get_logger("worker").info("links_measured", worker_id=s.worker_id, down=round(links.down),
                                        up=round(links.up), latency_s=round(links.latency_s, 4), bounded=links.bounded,
                                        flops=round(flops))
    return DeviceProfile(flops=flops, memory_bytes=s.memory_bytes, downlink_bytes_per_s=links.down,
                         uplink_bytes_per_s=links.up, latency_s=links.latency_s)


async def first_profile(s: WorkerSettings, bus: busmod.Bus, flops: float, stop: asyncio.Event) -> DeviceProfile | None:
    """Probe until the links are measured (None if stopped first): an unmeasured worker does not join."""
    while True:
        try:
            return await measured_profile(s, bus, flops)
        except Exception as e:  # ProbeFailed, or the connection failed under the probe
            structlog.get_logger("worker").info("links_not_measured", reason=repr(e), retry_s=DEFAULT_PROBE_RETRY_S)
        if await wait_for_stop(stop, DEFAULT_PROBE_RETRY_S):
            return None


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> int:
    torch.set_num_threads(settings.threads)
    return await run_worker(settings, stop, measure_flops())


async def run_worker(settings: WorkerSettings, stop: asyncio.Event, flops: float,
                     shared: DeviceProfile | None = None) -> int:
    """One worker on its own NATS connection until `stop`: what `serve` runs, and what `cleave swarm` runs
    many of in one event loop. `shared`: a profile measured once for the whole process (not re-probed)."""
    log = structlog.get_logger("worker").bind(worker_id=settings.worker_id)
    declared = parse_profile(settings.profile) if settings.profile else None
    bus = await busmod.connect(settings.nats_url, f"cleave-worker-{settings.worker_id}",
                               **auth.connect_options(settings, "worker"))
    # a measuring device probes on a connection of its own: a re-probe's upload (up to MAX_PROBE_BYTES) would
    # otherwise sit in the tiles' socket ahead of every result sent after it (half a second at 5 MB/s up)
    probe_bus = None if declared is not None or shared is not None else await busmod.connect(
        settings.nats_url, f"cleave-worker-{settings.worker_id}-probe", **auth.connect_options(settings, "worker"))
    profile = declared or shared or await first_profile(settings, probe_bus, flops, stop)
    if profile is None:  # stopped before the links could be measured
        await bus.close()
        if probe_bus is not None:
            await probe_bus.close()
        return 0
    # a real device beats on its own connection, so that no result, probe or reconnect backlog on the
    # bulk one delays its heartbeats (a swarm's emulated workers share one machine and keep one each)
    hb_bus = None if shared is not None else await busmod.connect(
        settings.nats_url, f"cleave-worker-{settings.worker_id}-hb", **auth.connect_options(settings, "worker"))
    worker = Worker(settings, bus, profile, hb_bus, probe_bus)
    sub = await bus.subscribe(SUBJECT_TILES.format(worker_id=settings.worker_id), TileTask, worker.on_tile)
    rounds = await bus.subscribe(SUBJECT_ROUNDS.format(worker_id=settings.worker_id), RoundTask, worker.on_round)
    cast = await bus.subscribe(SUBJECT_ROUNDCAST_ALL, RoundTask, worker.on_roundcast)
    splits = await bus.subscribe(SUBJECT_SPLIT.format(worker_id=settings.worker_id), SplitTask, worker.on_split)
    control = await bus.serve(SUBJECT_CONTROL.format(worker_id=settings.worker_id), FanoutJoin, worker.on_join)
    check = await bus.serve(SUBJECT_LINKCHECK.format(worker_id=settings.worker_id), LinkCheck, worker.on_check,
                            max_bytes=MAX_LINKCHECK_BYTES + 1024)  # on the tiles' connection: it proves that one
    log.info("worker_started", flops=f"{profile.flops / 1e9:.1f}G", down=f"{profile.downlink_bytes_per_s / 1e6:.0f}MB/s",
             up=f"{profile.uplink_bytes_per_s / 1e6:.0f}MB/s", declared=profile.declared,
             memory_bytes=settings.memory_bytes, cache_bytes=settings.cache_bytes, nats=settings.nats_url)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(worker.heartbeats(stop))
        tg.create_task(worker.uploads())
        tg.create_task(worker.close_outbox(stop))
        if declared is None and shared is None:
            tg.create_task(worker.reprobe(stop))
    await sub.unsubscribe()
    await rounds.unsubscribe()
    await cast.unsubscribe()
    await splits.unsubscribe()
    await control.unsubscribe()
    await check.unsubscribe()
    await bus.close()
    for extra in (hb_bus, probe_bus):
        if extra is not None:
            await extra.close()
    log.info("worker_stopped", tiles_done=worker.tiles_done, cache_hits=worker.cache.hits, stale_dropped=worker.stale)
    return 0


def main(settings: WorkerSettings | None = None) -> int:
    settings = settings or WorkerSettings()
    configure("worker")
    return run(lambda stop: serve(settings, stop))
