"""The scheduler's plans for this PS, followed from the plan bucket: the one watcher every job uses.

Each valid plan published under the PS's key (`PLAN_KEY`, or its replica's) becomes `current`, its workers
`workers`, and is handed to `on_plan` (the dispatcher's `set_plan` in pretraining); `changed` is set for
whoever waits for the fleet to change (rounds, split learning). A plan that does not decode is refused with
a logged reason and the last good one stays.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

from cleave import codec
from cleave.bus import Bus
from cleave.errors import WireError
from cleave.schemas import MAX_PLAN_BYTES, PLAN_BUCKET, PLAN_KEY, Plan
from cleave_ps.fleet.idle import NOTICE_S


class PlanWatch:
    def __init__(self, bus: Bus, key: str = PLAN_KEY,
                 on_plan: Callable[[Plan], Awaitable[None] | None] | None = None) -> None:
        self.bus, self.key, self.on_plan = bus, key, on_plan
        self.current: Plan | None = None
        self.workers: frozenset[str] = frozenset()
        self.changed = asyncio.Event()  # set by every plan; whoever waits for one clears it first

    async def on_entry(self, key: str, operation: str, value: bytes | None) -> None:
        if not value:
            return
        try:
            plan = codec.decode(value, Plan, MAX_PLAN_BYTES)
        except WireError as e:
            self.bus.reject(e.reason, "plan", str(e))
            return
        self.current, self.workers = plan, frozenset(w.worker_id for w in plan.workers)
        if self.on_plan is not None and inspect.isawaitable(applied := self.on_plan(plan)):
            await applied
        self.changed.set()

    async def follow(self, stop: asyncio.Event) -> None:
        """Every plan under the key (the current one first) until `stop`."""
        await self.bus.watch(PLAN_BUCKET, self.key, self.on_entry, stop)

    async def some_workers(self, stop: asyncio.Event, notice: Callable[[], Awaitable[None]] | None = None
                           ) -> frozenset[str]:
        """The workers of the first plan that has any (empty once `stop` is set); `notice` is awaited every
        NOTICE_S while there are none (`WaitNotice.waiting`)."""
        while not self.workers and not stop.is_set():
            self.changed.clear()
            await first_of(self.changed, stop, timeout_s=NOTICE_S if notice else None)
            if notice is not None and not self.workers and not stop.is_set():
                await notice()
        return self.workers


async def first_of(*waits: asyncio.Event | asyncio.Future, timeout_s: float | None = None) -> None:
    """Return once any event is set or future done, or after `timeout_s` (None: no limit)."""
    pending = [asyncio.ensure_future(w.wait()) if isinstance(w, asyncio.Event) else w for w in waits]
    own = [p for p, w in zip(pending, waits, strict=True) if p is not w]
    try:
        await asyncio.wait(pending, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for p in own:
            p.cancel()
