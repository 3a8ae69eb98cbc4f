"""The scheduler lays out large fleets in a planning process of its own: the same plan as in-process, and a
thread plans until that process has started (or after it died)."""

import time

from cleave_scheduler.main import PROCESS_MIN_DEVICES, Scheduler
from cleave_scheduler.planning import with_layouts
from cleave_scheduler.settings import SchedulerSettings
from cleave_scheduler.synthetic import job_shapes, synthetic_registry


async def test_a_large_fleet_is_planned_in_the_planning_process_exactly_as_in_process():
    sched = Scheduler(SchedulerSettings(), bus=None)
    try:
        sched.registry = synthetic_registry(PROCESS_MIN_DEVICES + 20, seed=2)
        sched.shapes = job_shapes("tiny", 8, 64, 4)
        first = await sched.make_plan("start")  # the process is starting: a thread planned this one
        assert sched.planner is not None and first.planner == "cost"
        sched._warm.result(timeout=120)
        assert sched._executor(len(first.workers)) is sched.planner
        started = time.monotonic()
        second = await sched.make_plan("join")
        assert time.monotonic() - started < 60
        want = with_layouts(second.model_copy(update={"gemms": (), "predicted_step_s": None,
                                                      "lower_bound_s": None, "planner": "uniform"}),
                            sched.shapes, "cost", None)
        assert [(g.m, g.n, g.k, g.owners, g.boxes.tolist()) for g in second.gemms] == \
            [(g.m, g.n, g.k, g.owners, g.boxes.tolist()) for g in want.gemms]
        assert second.predicted_step_s == want.predicted_step_s
    finally:
        sched.close()


async def test_a_small_fleet_is_planned_in_a_thread_and_starts_no_process():
    sched = Scheduler(SchedulerSettings(), bus=None)
    sched.registry = synthetic_registry(8, seed=2)
    sched.shapes = job_shapes("tiny", 8, 64, 4)
    plan = await sched.make_plan("start")
    assert plan.planner == "cost" and plan.gemms and sched.planner is None
    sched.close()
