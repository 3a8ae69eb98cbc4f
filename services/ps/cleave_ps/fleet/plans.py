"""Which workers the scheduler's current plan lists, followed from the plan bucket (rounds and split)."""

from __future__ import annotations

import asyncio

from cleave import codec
from cleave.bus import Bus
from cleave.errors import WireError
from cleave.schemas import MAX_PLAN_BYTES, PLAN_BUCKET, PLAN_KEY, Plan


class PlanView:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.workers: set[str] = set()

    def on_entry(self, key: str, operation: str, value: bytes | None) -> None:
        if not value:
            return
        try:
            plan = codec.decode(value, Plan, MAX_PLAN_BYTES)
        except WireError as e:  # a bad plan is refused; the last good one stays
            self.bus.reject(e.reason, "plan", str(e))
            return
        self.workers = {w.worker_id for w in plan.workers}

    async def follow(self, stop: asyncio.Event) -> None:
        await self.bus.watch(PLAN_BUCKET, PLAN_KEY, self.on_entry, stop)
