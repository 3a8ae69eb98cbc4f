"""The scheduler on a real nats-server: cost-aware plans for the job's GEMMs, re-planned on join and leave."""

from __future__ import annotations

import asyncio
import time

from cleave import bus as busmod
from cleave import codec
from cleave.api.fleet import LocalFleet
from cleave.gemm import tiles
from cleave.models import gemm_shapes, get_preset
from cleave.schemas import (
    NO_JOB,
    PLAN_BUCKET,
    PLAN_KEY,
    SHAPES_KEY,
    Event,
    GemmSpec,
    JobShapes,
    Plan,
    events_subject,
)

PROFILES = ["flops=2G,down=20M,up=5M,latency=0.01,memory=512Mi", "flops=0.5G,down=5M,up=2M,latency=0.02,memory=512Mi"]


async def next_plan(bus: busmod.Bus, after: int, timeout_s: float = 20.0) -> Plan:
    kv = await bus.kv(PLAN_BUCKET)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await bus.kv_get(kv, PLAN_KEY, Plan)
        if got and got[0].version > after:
            return got[0]
        await asyncio.sleep(0.05)  # polling the KV for the test's observation, not ordering anything
    raise TimeoutError(f"no plan after version {after}")


def check_layouts(plan: Plan, shapes: JobShapes) -> None:
    ids = {w.worker_id for w in plan.workers}
    by_shape = {(g.m, g.n, g.k): g for g in plan.gemms}
    for spec in shapes.gemms:
        layout = by_shape[(spec.m, spec.n, spec.k)]
        boxes = [tuple(layout.boxes[4 * i : 4 * i + 4]) for i in range(len(layout.owners))]
        tiles.check_cover(tiles.from_boxes(boxes), spec.m, spec.n)  # exact: no gap, no overlap
        assert set(layout.owners) <= ids


async def test_cost_aware_plan_and_replanning_on_join_and_leave(tmp_path, nats_url):
    fleet = LocalFleet(tmp_path, 0, nats_url=nats_url)
    bus = await busmod.connect(nats_url, "test")
    try:
        fleet.start()
        for i, spec in enumerate(PROFILES):
            fleet.stack.service(f"w{i}", "worker", ["--worker-id", f"w{i}", "--profile", spec])
        await bus.setup()
        plan = await next_plan(bus, 0)
        while len(plan.workers) < 2:
            plan = await next_plan(bus, plan.version)
        shapes = JobShapes(job="j", gemms=tuple(GemmSpec(name=g.name, m=g.m, n=g.n, k=g.k, count_per_step=g.count_per_step)
                                                for g in gemm_shapes(get_preset("tiny"), 8, 64)))
        await bus.kv_put(await bus.kv(PLAN_BUCKET), SHAPES_KEY, shapes)
        plan = await next_plan(bus, plan.version)
        assert plan.planner == "cost" and plan.predicted_step_s > 0 and plan.lower_bound_s <= plan.predicted_step_s
        check_layouts(plan, shapes)

        # join: a third device
        fleet.stack.service("w2", "worker", ["--worker-id", "w2", "--profile", PROFILES[0]])
        while "w2" not in {w.worker_id for w in plan.workers}:
            plan = await next_plan(bus, plan.version)
        check_layouts(plan, shapes)

        fleet.stack.kill("w1", restart=False)  # leave: heartbeats stop
        t0 = time.monotonic()
        while "w1" in {w.worker_id for w in plan.workers}:
            plan = await next_plan(bus, plan.version)
        # re-planned without it once its heartbeats stopped for the liveness period (1 s); how fast the re-plan
        # itself is belongs to a benchmark (benchmarks/fleet_scale.py), not to an assertion on a loaded machine
        assert time.monotonic() - t0 < 15.0
        check_layouts(plan, shapes)
        assert "leave" in plan.reason
    finally:
        await bus.close()
        fleet.stop()


async def test_two_workers_under_one_id_are_said(tmp_path, nats_url):
    """Two worker processes started with one --worker-id (two machines given one credential folder): the
    scheduler says so (log and event) instead of seeing one worker come and go."""
    fleet = LocalFleet(tmp_path, 0, nats_url=nats_url)
    bus = await busmod.connect(nats_url, "test")
    seen: list[Event] = []
    said = asyncio.Event()

    async def on_event(m) -> None:  # noqa: ANN001 - a nats-py Msg
        seen.append(codec.decode(m.data, Event))
        said.set()

    try:
        await bus.setup()
        sub = await bus.nc.subscribe(events_subject("worker_id_shared", NO_JOB), cb=on_event)
        fleet.start()
        for name in ("a", "b"):
            fleet.stack.service(f"w-{name}", "worker", ["--worker-id", "twin", "--profile", PROFILES[0]])
        await asyncio.wait_for(said.wait(), 60)
        await sub.unsubscribe()
    finally:
        await bus.close()
        fleet.stop()
    assert seen and seen[0].worker_id == "twin" and seen[0].detail["started_a"] != seen[0].detail["started_b"]
    assert "worker_id_shared" in (tmp_path / "logs" / "scheduler.log").read_text()
