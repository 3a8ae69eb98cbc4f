"""This worker as the fleet sees it: its profile (measured, or declared and paced to), what it has done and is
computing, its heartbeats on a connection of their own and the re-measurement of its links and FLOPS."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import structlog

from cleave import bus as busmod
from cleave.bus.stopping import done_unless_stopped
from cleave.plan.profile import Pacer
from cleave.runtime.faults import Faults
from cleave.runtime.lifecycle import wait_for_stop
from cleave.schemas import SUBJECT_HEARTBEAT, DeviceProfile, Heartbeat
from cleave_worker.core import measure_flops
from cleave_worker.probe import measure_links
from cleave_worker.settings import WorkerSettings

DEFAULT_PROBE_RETRY_S = 1.0  # until its links are measured a worker does not join (it is planned not at all)


class DeviceState:
    """What the tiles, the rounds and the heartbeats of one worker share: its settings and profile, a pacer
    when the profile is declared, its fault injection, and its busy counters."""

    def __init__(self, settings: WorkerSettings, bus: busmod.Bus, profile: DeviceProfile,
                 hb_bus: busmod.Bus | None = None, probe_bus: busmod.Bus | None = None) -> None:
        self.s, self.profile = settings, profile
        self.hb_bus = hb_bus or bus  # heartbeats on their own connection: never queued behind results or probes
        self.probe_bus = probe_bus or bus  # probes on theirs: a re-probe's megabytes never queue ahead of results
        self.started_at = time.time()
        self.tiles_done = 0
        self.computing = 0  # tiles and rounds computing now (a FLOPS re-measurement beside them is discarded)
        self.computations = 0  # ... and begun so far
        self.busy_s = 0.0
        self.faults = Faults(settings.fail_at, settings.fault_dir, tag=settings.worker_id)
        self.pacer = Pacer(profile) if profile.declared else None
        self.log = structlog.get_logger("worker").bind(worker_id=settings.worker_id)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        self.computing += 1
        self.computations += 1
        try:
            yield
        finally:
            self.computing -= 1

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
                measuring = asyncio.ensure_future(measured_profile(self.s, self.probe_bus, flops))
                if not await done_unless_stopped(measuring, stop):  # (refused echoes may wait minutes)
                    return
                self.profile = measuring.result()
            except Exception as e:  # e.g. the scheduler restarting: measure again next time
                self.log.warning("reprobe_failed", error=repr(e))



async def measured_profile(s: WorkerSettings, bus: busmod.Bus, flops: float) -> DeviceProfile:
    """This device as it is: GEMM FLOPS, and its links to the hub as the probes prove them (ProbeFailed
    when the scheduler does not answer)."""
    links = await measure_links(bus, s.worker_id)
    # bounded: a probe timed out, the link is at most this fast, and that is what we report
    structlog.get_logger("worker").info("links_measured", worker_id=s.worker_id, down=round(links.down),
                                        up=round(links.up), latency_s=round(links.latency_s, 4), bounded=links.bounded,
                                        flops=round(flops))
    return DeviceProfile.within(flops=flops, memory_bytes=s.memory_bytes, downlink_bytes_per_s=links.down,
                                uplink_bytes_per_s=links.up, latency_s=links.latency_s)


async def first_profile(s: WorkerSettings, bus: busmod.Bus, flops: float, stop: asyncio.Event) -> DeviceProfile | None:
    """Probe until the links are measured (None if stopped first): an unmeasured worker does not join."""
    while True:
        measuring = asyncio.ensure_future(measured_profile(s, bus, flops))
        try:  # (a stop cuts a measurement short: against a server gone, its probes took 13 s to time out)
            return measuring.result() if await done_unless_stopped(measuring, stop) else None
        except Exception as e:  # ProbeFailed, or the connection failed under the probe
            structlog.get_logger("worker").info("links_not_measured", reason=repr(e), retry_s=DEFAULT_PROBE_RETRY_S)
        if await wait_for_stop(stop, DEFAULT_PROBE_RETRY_S):
            return None


