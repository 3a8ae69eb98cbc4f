"""Turn the registry's fleet and the job's GEMM shapes into a plan (pure: no NATS)."""

from __future__ import annotations

from cleave import planner
from cleave.schemas import GemmLayout, JobShapes, Plan

PLANNERS = ("cost", "even", "uniform")


def with_layouts(plan: Plan, shapes: JobShapes | None, kind: str, ps_bandwidth: float | None) -> Plan:
    """`plan` with per-GEMM blocks from the cost-aware planner ("cost"), the even split over every device
    ("even"), or none ("uniform": tiles of one shape dealt from a queue)."""
    if kind == "uniform" or shapes is None or not plan.workers:
        return plan
    devices = {w.worker_id: w.profile for w in plan.workers}
    specs = list(shapes.gemms)
    model = (planner.plan_model if kind == "cost" else planner.even_split_model)(
        devices, specs, shapes.dtype_bytes, ps_bandwidth
    )
    layouts = []
    for g in model.gemms:
        boxes: list[int] = []
        owners: list[str] = []
        for a in g.assignments:
            boxes += [a.row0, a.row1, a.col0, a.col1]
            owners.append(a.device)
        layouts.append(GemmLayout(m=g.m, n=g.n, k=g.k, boxes=tuple(boxes), owners=tuple(owners), makespan_s=g.makespan_s))
    return plan.model_copy(update={
        "gemms": tuple(layouts), "predicted_step_s": model.predicted_step_s, "lower_bound_s": model.lower_bound_s,
        "planner": kind,
    })
