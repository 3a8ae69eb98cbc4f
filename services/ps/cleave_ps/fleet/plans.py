"""The scheduler's plans followed from the plan bucket: applied to the dispatcher (pretraining), or which workers
the current plan lists (rounds and split)."""

from __future__ import annotations

import asyncio

from cleave import bus as busmod
from cleave import codec
from cleave.bus import Bus
from cleave.errors import WireError
from cleave.schemas import MAX_PLAN_BYTES, PLAN_BUCKET, PLAN_KEY, Plan
from cleave_ps.fleet.dispatcher import Dispatcher


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


async def watch_plans(bus: busmod.Bus, dispatcher: Dispatcher, stop: asyncio.Event, key: str = PLAN_KEY) -> None:
    """Apply every plan the scheduler publishes under `key` (the current one first)."""

    async def on_entry(key: str, operation: str, value: bytes | None) -> None:
        if not value:
            return
        try:
            plan = busmod.codec.decode(value, Plan, MAX_PLAN_BYTES)
        except busmod.WireError as e:
            bus.reject(e.reason, "plan", str(e))
            return
        await dispatcher.set_plan(plan)

    await bus.watch(PLAN_BUCKET, key, on_entry, stop)
