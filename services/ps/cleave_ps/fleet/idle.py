"""The PS's word that it has no worker to deal to (none joined, all left, or all expelled as faulty): a log line
each time it is told, and a `waiting_for_workers` event in the hub's events stream (what `cleave status` and the
dashboard show) when a wait begins and every WAIT_EVENT_S while it lasts. A wait is one run of notices no
further apart than twice the longest pause between them a caller makes (`gap_s`: NOTICE_S and what a caller may
add to it)."""

from __future__ import annotations

import time

import structlog

from cleave.bus import Bus
from cleave.schemas import Event
from cleave.schemas.jobs import WAIT_EVENT_S

log = structlog.get_logger("ps")
NOTICE_S = 5.0  # how often a PS waiting for workers says so in its log


class WaitNotice:
    def __init__(self, bus: Bus, job_id: str, gap_s: float) -> None:
        self.bus, self.job_id, self.gap_s = bus, job_id, gap_s
        self.since = 0.0  # wall time the current wait began
        self._last = self._told = -float("inf")  # monotonic: the last notice, the last event

    async def waiting(self, step: int | None, faulty: int = 0, **logged: object) -> None:
        """No worker to deal to at `step`; `faulty`: workers expelled for wrong results (never dealt to again)."""
        now = time.monotonic()
        if now - self._last > 2 * self.gap_s:  # a new wait
            self.since, self._told = time.time(), -float("inf")
        self._last = now
        log.warning("waiting_for_workers", step=step, faulty=faulty, since=round(self.since, 3), **logged)
        if now - self._told >= WAIT_EVENT_S:
            self._told = now
            await self.bus.emit(Event(kind="waiting_for_workers", at=time.time(), job=self.job_id, step=step,
                                      detail={"since": self.since, "faulty": faulty}))
