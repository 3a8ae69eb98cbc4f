"""A 10,000-device plan goes scheduler -> JetStream KV -> PS on a real nats-server (default 1 MB max_payload).

Registering 10,000 devices by heartbeats would take minutes, so the scheduler's registry is filled with
synthetic devices; everything after that is the real path: `Scheduler.publish_plans` plans and puts the
plan in the KV, the PS's `PlanWatch` decodes it and its dispatcher applies it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from cleave import bus as busmod
from cleave.schemas import MAX_PLAN_BYTES, PLAN_BUCKET, PLAN_KEY, Plan
from cleave_scheduler.main import Scheduler
from cleave_scheduler.settings import SchedulerSettings
from cleave_scheduler.synthetic import job_shapes, synthetic_registry
from tests.integration.fleet import InProcessPS

DEVICES = 10_000
APPLY_TIMEOUT_S = 120.0  # planning 10,000 devices takes seconds on a loaded 2-core machine


async def wait_applied(ps: InProcessPS, timeout_s: float) -> Plan:
    deadline = time.monotonic() + timeout_s
    while (plan := ps.dispatcher.plan) is None or len(plan.workers) < DEVICES:
        if time.monotonic() > deadline:
            raise TimeoutError("the PS did not apply the 10,000-device plan")
        await asyncio.sleep(0.05)  # observing the PS, not ordering anything
    return plan


@pytest.mark.slow  # ~16 s; the 10,000-device plan's size and speed are benchmarks/plan_wire.py's and planner.py's
async def test_a_10000_device_plan_reaches_the_ps_through_the_kv(nats_url):
    stop = asyncio.Event()
    bus = await busmod.connect(nats_url, "cleave-scheduler")
    try:
        await bus.setup()
        sched = Scheduler(SchedulerSettings(nats_url=nats_url, liveness_s=0.05), bus)
        await sched.start()
        sched.registry = synthetic_registry(DEVICES)
        sched.shapes = shapes = job_shapes("gpt2-medium", 8, 1024, 4)
        sched.reasons.append("start")
        sched.changed.set()
        async with InProcessPS(nats_url) as ps:
            publisher = asyncio.create_task(sched.publish_plans(stop))
            applied = await wait_applied(ps, APPLY_TIMEOUT_S)
            stop.set()
            await asyncio.wait_for(publisher, 10)
            assert set(ps.dispatcher.workers) == set(applied.workers.ids) == set(sched.registry.devices)
            kv = await bus.kv(PLAN_BUCKET)
            entry = await kv.get(PLAN_KEY)
            assert len(entry.value) < 1024 * 1024  # one NATS message at the server's default max_payload
            stored, _ = await bus.kv_get(kv, PLAN_KEY, Plan, MAX_PLAN_BYTES)
            assert applied == stored and applied.planner == "cost"
            by_shape = {(g.m, g.n, g.k): g for g in applied.gemms}
            assert set(by_shape) == {(g.m, g.n, g.k) for g in shapes.gemms}
            assert sum(len(g.owners) for g in applied.gemms) > 90_000
            for g in applied.gemms:
                assert set(g.owners) <= set(ps.dispatcher.workers)
                assert len(g.boxes) == 4 * len(g.owners)
    finally:
        stop.set()
        if "sched" in locals():
            sched.close()
        await bus.close()
