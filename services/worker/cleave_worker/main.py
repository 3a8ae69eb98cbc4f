"""The worker service: dial out to NATS, register, heartbeat, take tiles, compute them, return blocks.

A worker is three parts on one set of connections: its `DeviceState` (profile, heartbeats, re-probing), its
`Tiles` (fan-out groups, link checks, tiles and their uploads) and its `Methods` (rounds, split learning)."""

from __future__ import annotations

import asyncio

import structlog

from cleave import auth
from cleave import bus as busmod
from cleave.plan.profile import parse_profile
from cleave.runtime.lifecycle import run
from cleave.runtime.logs import configure
from cleave.runtime.threads import use_threads
from cleave.schemas import (
    MAX_LINKCHECK_BYTES,
    SUBJECT_CONTROL,
    SUBJECT_LINKCHECK,
    SUBJECT_ROUNDCAST_ALL,
    SUBJECT_ROUNDS,
    SUBJECT_SECAGG,
    SUBJECT_SPLIT,
    SUBJECT_TILES,
    DeviceProfile,
    FanoutJoin,
    LinkCheck,
    RoundTask,
    SecAggTask,
    SplitTask,
    TileTask,
)
from cleave.train.sources import source_bytes
from cleave_worker.core import measure_flops
from cleave_worker.device import DeviceState, first_profile
from cleave_worker.methods import Methods
from cleave_worker.settings import WorkerSettings
from cleave_worker.tiles import Tiles


class Worker:
    """One worker's parts (see the module docstring)."""

    def __init__(self, settings: WorkerSettings, bus: busmod.Bus, profile: DeviceProfile,
                 hb_bus: busmod.Bus | None = None, probe_bus: busmod.Bus | None = None) -> None:
        self.device = DeviceState(settings, bus, profile, hb_bus, probe_bus)
        self.tiles = Tiles(self.device, bus)
        self.methods = Methods(self.device, bus)


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> int:
    use_threads(settings.threads)
    return await run_worker(settings, stop, 0.0 if settings.profile else measure_flops())  # (declared: not measured)


async def run_worker(settings: WorkerSettings, stop: asyncio.Event, flops: float,
                     shared: DeviceProfile | None = None) -> int:
    """One worker on its own NATS connection until `stop`: what `serve` runs, and what `cleave swarm` runs
    many of in one event loop. `shared`: a profile measured once for the whole process (not re-probed)."""
    log = structlog.get_logger("worker").bind(worker_id=settings.worker_id)
    if settings.data:  # its own data: checked now, and only its size is ever told (never its path or content)
        log.info("data_declared", bytes=await asyncio.to_thread(source_bytes, settings.data))
    declared = parse_profile(settings.profile) if settings.profile else None
    options = auth.connect_options(settings, "worker")
    bus = await busmod.connect(settings.nats_url, f"cleave-worker-{settings.worker_id}", stop=stop, **options)
    if bus is None:  # stopped before NATS answered
        return 0
    # a measuring device probes on a connection of its own: a re-probe's upload (up to MAX_PROBE_BYTES) would
    # otherwise sit in the tiles' socket ahead of every result sent after it (half a second at 5 MB/s up)
    probe_bus = None if declared is not None or shared is not None else await busmod.connect(
        settings.nats_url, f"cleave-worker-{settings.worker_id}-probe", stop=stop, **options)
    profile = None if stop.is_set() else declared or shared or await first_profile(settings, probe_bus, flops, stop)
    # a real device beats on its own connection, so that no result, probe or reconnect backlog on the
    # bulk one delays its heartbeats (a swarm's emulated workers share one machine and keep one each)
    hb_bus = None if shared is not None or profile is None else await busmod.connect(
        settings.nats_url, f"cleave-worker-{settings.worker_id}-hb", stop=stop, **options)
    if profile is None or stop.is_set():  # stopped before the links could be measured, or connected
        for b in (bus, probe_bus, hb_bus):
            if b is not None:
                await b.close()
        return 0
    worker = Worker(settings, bus, profile, hb_bus, probe_bus)
    tiles, methods = worker.tiles, worker.methods
    sub = await bus.subscribe(SUBJECT_TILES.format(worker_id=settings.worker_id), TileTask, tiles.on_tile)
    rounds = await bus.subscribe(SUBJECT_ROUNDS.format(worker_id=settings.worker_id), RoundTask, methods.on_round)
    cast = await bus.subscribe(SUBJECT_ROUNDCAST_ALL, RoundTask, methods.on_roundcast)
    splits = await bus.subscribe(SUBJECT_SPLIT.format(worker_id=settings.worker_id), SplitTask, methods.on_split)
    secure = await bus.subscribe(SUBJECT_SECAGG.format(worker_id=settings.worker_id), SecAggTask, methods.on_secagg)
    control = await bus.serve(SUBJECT_CONTROL.format(worker_id=settings.worker_id), FanoutJoin, tiles.on_join)
    check = await bus.serve(SUBJECT_LINKCHECK.format(worker_id=settings.worker_id), LinkCheck, tiles.on_check,
                            max_bytes=MAX_LINKCHECK_BYTES + 1024)  # on the tiles' connection: it proves that one
    log.info("worker_started", flops=f"{profile.flops / 1e9:.1f}G", down=f"{profile.downlink_bytes_per_s / 1e6:.0f}MB/s",
             up=f"{profile.uplink_bytes_per_s / 1e6:.0f}MB/s", declared=profile.declared,
             memory_bytes=settings.memory_bytes, cache_bytes=settings.cache_bytes, nats=settings.nats_url)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(worker.device.heartbeats(stop))
        tg.create_task(tiles.uploads())
        tg.create_task(tiles.close_outbox(stop))
        if declared is None and shared is None:
            tg.create_task(worker.device.reprobe(stop))
    await sub.unsubscribe()
    await rounds.unsubscribe()
    await cast.unsubscribe()
    await splits.unsubscribe()
    await secure.unsubscribe()
    await control.unsubscribe()
    await check.unsubscribe()
    await bus.close()
    for extra in (hb_bus, probe_bus):
        if extra is not None:
            await extra.close()
    log.info("worker_stopped", tiles_done=worker.device.tiles_done, cache_hits=tiles.cache.hits, stale_dropped=tiles.stale)
    return 0


def main(settings: WorkerSettings | None = None) -> int:
    settings = settings or WorkerSettings()
    configure("worker")
    return run(lambda stop: serve(settings, stop))
