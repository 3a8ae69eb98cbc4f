"""What the scheduler writes to JetStream (registry entries, events), queued and written by one task, so that
handling a heartbeat never waits on a JetStream acknowledgement.

Awaited in the heartbeat handler, one write per join and per refresh made 1,000 swarm workers (1 heartbeat
a second each) queue behind the acknowledgements on a loaded machine, miss their liveness and flap
(benchmarks/fleet_scale.py). Pending registry writes keep only the latest state of each worker (at most
one entry per worker waits); events wait in a bounded queue (the oldest are dropped, and counted).
"""

from __future__ import annotations

import asyncio
from collections import deque

import structlog
from nats.js.kv import KeyValue

from cleave import bus as busmod
from cleave.schemas import DeviceRecord, Event

log = structlog.get_logger("scheduler")
DEFAULT_MAX_EVENTS = 10_000


class Outbox:
    def __init__(self, bus: busmod.Bus, registry_kv: KeyValue, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.bus, self.kv = bus, registry_kv
        self.records: dict[str, DeviceRecord | None] = {}  # worker id -> its entry to write, None: delete it
        self.events: deque[Event] = deque(maxlen=max_events)
        self.dropped = 0  # events pushed out of a full queue
        self.dirty = asyncio.Event()

    def put(self, rec: DeviceRecord) -> None:
        self.records[rec.worker_id] = rec
        self.dirty.set()

    def delete(self, worker_id: str) -> None:
        self.records[worker_id] = None
        self.dirty.set()

    def emit(self, event: Event) -> None:
        self.dropped += len(self.events) == self.events.maxlen
        self.events.append(event)
        self.dirty.set()

    async def flush(self) -> None:
        """Write everything pending (events after the registry); failures are logged, not retried."""
        while self.records:
            worker_id, rec = self.records.popitem()
            try:
                if rec is None:
                    await asyncio.wait_for(self.kv.delete(worker_id), busmod.DEFAULT_TIMEOUT_S)
                else:
                    await self.bus.kv_put(self.kv, worker_id, rec)
            except Exception as e:  # NATS down or slow: the next heartbeat refresh writes it again
                log.warning("registry_write_failed", worker_id=worker_id, delete=rec is None, error=repr(e))
        while self.events:
            await self.bus.emit(self.events.popleft())  # logs and drops when the stream cannot take it

    async def run(self, stop: asyncio.Event) -> None:
        """Write whatever is pending until `stop`, then once more."""
        while not stop.is_set():
            waiter, stopper = asyncio.ensure_future(self.dirty.wait()), asyncio.ensure_future(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            stopper.cancel()
            self.dirty.clear()
            await self.flush()
        await self.flush()
