"""Turn the registry's fleet and the job's GEMM shapes into a plan (pure: no NATS)."""

from __future__ import annotations

import numpy as np

from cleave import codec
from cleave.gemm.predict import step_makespans
from cleave.models import step_order
from cleave.plan import planner
from cleave.schemas import MAX_CONTROL_BYTES, MAX_PLAN_BYTES, GemmLayout, JobShapes, Plan

PLANNERS = ("cost", "even", "uniform")


def with_layouts(plan: Plan, shapes: JobShapes | None, kind: str, ps_bandwidth: float | None) -> Plan:
    """`plan` with per-GEMM blocks from the cost-aware planner ("cost"), the even split over every device
    ("even"), or none ("uniform": tiles of one shape dealt from a queue). Each layout's `makespan_s` and the
    plan's `predicted_step_s` are what the run time will take (`cleave.gemm.predict.step_makespans`: the PS's
    dealing core on the workers' profiles over a step's GEMMs, copies of late pieces included; and the PS's
    egress); `lower_bound_s` is the planner's relaxation bound."""
    if kind == "uniform" or shapes is None or not plan.workers:
        return plan
    devices = {w.worker_id: w.profile for w in plan.workers}
    caches = {w.worker_id: w.cache_bytes for w in plan.workers}
    specs = list(shapes.gemms)
    model = (planner.plan_model if kind == "cost" else planner.even_split_model)(
        devices, specs, shapes.dtype_bytes, ps_bandwidth, shapes.memory_dtype_bytes
    )
    kinds = [([(a.row0, a.row1, a.col0, a.col1) for a in g.assignments], [a.device for a in g.assignments], g.k)
             for g in model.gemms]
    layer = list(dict.fromkeys(step_order(model.gemms)))  # a step of one layer: each kind once, in step order
    dealt = step_makespans(kinds, layer, devices, shapes.dtype_bytes, plan.tile_rows, plan.tile_cols, plan.chunks,
                           cache_bytes=caches)
    layouts, step_s = [], 0.0
    for g, (boxes, owners, _), fleet_s in zip(model.gemms, kinds, dealt, strict=True):
        makespan = max(fleet_s, g.egress_s)
        step_s += makespan * g.count_per_step
        layouts.append(GemmLayout(m=g.m, n=g.n, k=g.k, boxes=np.array(boxes, dtype=np.int64).reshape(-1),
                                  owners=owners, makespan_s=makespan))
    # validated (model_copy would not be): every box inside its GEMM, every owner a worker of the plan
    return Plan.model_validate({
        **dict(plan), "gemms": tuple(layouts), "predicted_step_s": step_s, "lower_bound_s": model.lower_bound_s,
        "planner": kind,
    })


def with_layouts_encoded(plan: bytes, shapes: bytes | None, kind: str, ps_bandwidth: float | None) -> bytes:
    """`with_layouts` on encoded messages: what the scheduler's planning process runs, so that planning a
    large fleet never competes for the interpreter with the heartbeats of that fleet."""
    job = codec.decode(shapes, JobShapes, MAX_CONTROL_BYTES) if shapes else None
    return codec.encode(with_layouts(codec.decode(plan, Plan, MAX_PLAN_BYTES), job, kind, ps_bandwidth))


def warm() -> None:
    """Nothing: calling it in the planning process imports this module there."""
