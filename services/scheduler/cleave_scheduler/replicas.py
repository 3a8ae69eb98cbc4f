"""The plans of a job's PS replicas: each replica's part of the fleet (`cleave.plan.partition`), cost-planned
for that replica's share of the batch and published under `REPLICA_PLAN_KEY`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from cleave.plan import partition
from cleave.schemas import REPLICA_PLAN_KEY, JobShapes, Plan

log = structlog.get_logger("scheduler")


class ReplicaPlans:
    """Splits each fleet plan among the job's replicas, keeping the last split sticky across churn."""

    def __init__(self) -> None:
        self.assignment: dict[str, int] = {}

    def split(self, plan: Plan, shapes: JobShapes | None) -> list[Plan]:
        """One plan per replica (none for a job with one PS)."""
        if shapes is None or shapes.replicas <= 1:
            return []
        rates = {w.worker_id: partition.device_rate(w.profile, shapes.gemms, shapes.dtype_bytes,
                                                    plan.tile_rows, plan.tile_cols) for w in plan.workers}
        self.assignment = partition.partition(rates, shapes.replicas, self.assignment)
        return partition.restrict(plan, self.assignment, shapes.replicas)

    async def publish(self, bus, kv, plan: Plan, shapes: JobShapes | None,  # noqa: ANN001
                      laid_out: Callable[[Plan], Awaitable[Plan]]) -> None:
        """Lay out (`laid_out`: the scheduler's planner) and publish every replica's part; raises what
        `kv_put` raises (NATS down)."""
        for r, part in enumerate(self.split(plan, shapes)):
            part = await laid_out(part)
            await bus.kv_put(kv, REPLICA_PLAN_KEY.format(replica=r), part)
            log.info("replica_plan_published", replica=r, version=part.version, workers=len(part.workers))
