"""Where a simulated step's time goes (pure: it reads the outcomes `Simulation.step` hands its hook).

Per GEMM kind: how often the step runs it, its seconds (each GEMM's span from its begin to its last result;
with deferred weight gradients, `Simulation.deferred`, the backward's GEMMs overlap and their seconds add up
to more than the step), what the PS sent against the kind's distinct inputs
`(m + n)·k·b`, how long the PS's link was busy with it, the input strips too big for the workers' block
cache (they travel with every tile that needs them and are never fanned out), the tail (the mean seconds a
device that took part waits after its last result until the GEMM's last one), speculative copies and
duplicates. Per device, over the step: the seconds its downlink, compute and uplink were busy (bytes over
its actual link, FLOPs over its actual FLOP/s: `up / b · 2k` FLOPs for the results it sent), which of the
three bounds it, and its idle share (1 - its busiest stage over the step). Floors beside them: the fleet's
compute (step FLOPs over the used devices' FLOP/s), the PS's egress for the distinct inputs, and the
planner's own (`GemmPlan.bound`, per GEMM the largest of its area relaxation over the devices' links and
FLOP/s, its FLOPs and the PS's egress; `planned_s` is the planner's makespan): no dealing of these GEMMs one
after another beats their sum. `busiest_device_s` (the most seconds any one device's stage was busy) is the
floor for any order of the same bytes on the same devices, GEMMs dealt concurrently included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cleave.gemm.engine import Outcome
from cleave.models import GemmShape
from cleave.sim.step import Simulation, StepStats

STAGES = ("down", "compute", "up")


@dataclass
class Kind:
    """One GEMM kind's share of the step, summed over the GEMMs of that kind."""

    m: int
    n: int
    k: int
    count: int = 0
    span_s: float = 0.0
    ps_bytes: float = 0.0
    ps_busy_s: float = 0.0
    copied: int = 0
    duplicates: int = 0
    tail_s: float = 0.0  # summed over the GEMMs simulated event by event (the others reuse a clean one's)
    tailed: int = 0
    stage_s: np.ndarray = field(default_factory=lambda: np.zeros(3))  # device-seconds: down, compute, up


@dataclass
class Tally:
    """The hook `Simulation.step` calls with each GEMM's outcome (`breakdown` reads it afterwards)."""

    sim: Simulation
    kinds: dict[str, Kind] = field(default_factory=dict)
    stage_s: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))  # per device: down, compute, up

    def __call__(self, shape: GemmShape, out: Outcome, simulated: bool) -> None:
        act, b = self.sim.world.actual, self.sim.dtype_bytes
        if len(self.stage_s) < len(act.flops):
            self.stage_s = np.vstack([self.stage_s, np.zeros((len(act.flops) - len(self.stage_s), 3))])
        kind = self.kinds.setdefault(shape.name, Kind(shape.m, shape.n, shape.k))
        kind.count += 1
        kind.span_s += out.span
        kind.ps_bytes += out.ps_bytes
        kind.ps_busy_s += min(out.ps_busy_s, out.span)
        kind.copied += out.copied
        kind.duplicates += out.duplicates
        for d in set(out.down) | set(out.up):
            down, up = out.down.get(d, 0.0), out.up.get(d, 0.0)
            secs = np.array([down / act.down[d], up / b * 2.0 * shape.k / act.flops[d], up / act.up[d]])
            self.stage_s[d] += secs
            kind.stage_s += secs
        if simulated and out.last:
            kind.tail_s += float(np.mean([out.end - t for t in out.last.values()]))
            kind.tailed += 1


def strips_over_cache(sim: Simulation, shape: GemmShape) -> dict[str, float]:
    """The kind's input strips (distinct row ranges of A and of Bᵀ in its planned tiles) larger than the
    workers' block cache: how many of all, and their share of the distinct strip bytes."""
    plan = sim.scheduler.plans[0]
    ts, _ = sim.cutter.tileset(0, plan, shape.m, shape.n, shape.k)
    row = shape.k * sim.dtype_bytes
    sizes = [(r1 - r0) * row for r0, r1 in {(t.r0, t.r1) for t in ts.tiles}]
    sizes += [(c1 - c0) * row for c0, c1 in {(t.c0, t.c1) for t in ts.tiles}]
    big = [s for s in sizes if s > sim.cache_bytes]
    return {"strips": len(sizes), "over_cache": len(big), "over_cache_bytes_share": sum(big) / sum(sizes)}


def planned(sim: Simulation, shape: GemmShape) -> dict[str, float]:
    """The planner's seconds for the kind (`count` GEMMs): its makespan (stages fully overlapped), its lower
    bound and the bound's device part (the area relaxation over the devices' links and FLOP/s), and the
    blocks streamed in pieces by each device alone (`dealing.streamed_makespan`: the first piece's download
    and the last one's upload overlap nothing, no piece copied; what the scheduler predicted before it dealt
    plans with the PS's dealer), or the PS's egress if longer."""
    plan = sim.scheduler.plans[0]
    gp = sim.cutter.gemm_plan(0, plan, shape.m, shape.n, shape.k)
    sim.cutter.tileset(0, plan, shape.m, shape.n, shape.k)
    dealt = max(sim.cutter.streamed[(0, shape.m, shape.n, shape.k)], gp.egress_s)
    c = shape.count_per_step
    return {"planned_s": gp.makespan_s * c, "lower_bound_s": gp.lower_bound_s * c,
            "device_bound_s": gp.bound.devices_s * c, "dealt_s": dealt * c}


def _kind_json(sim: Simulation, name: str, kind: Kind, step_s: float) -> dict[str, Any]:
    shape = GemmShape(name, kind.m, kind.n, kind.k, kind.count)
    distinct = float((kind.m + kind.n) * kind.k * sim.dtype_bytes * kind.count)
    stage = dict(zip(STAGES, (kind.stage_s / max(kind.span_s, 1e-12)).tolist(), strict=True))
    return {
        "m": kind.m, "n": kind.n, "k": kind.k, "count": kind.count,
        "seconds": kind.span_s, "share_of_step": kind.span_s / step_s,
        "compute_floor_s": 2.0 * kind.m * kind.n * kind.k * kind.count / _fleet_flops(sim),
        "ps_bytes": kind.ps_bytes, "distinct_input_bytes": distinct, "ps_bytes_over_distinct": kind.ps_bytes / distinct,
        "ps_link_busy_share": kind.ps_busy_s / max(kind.span_s, 1e-12),
        "busy_devices_by_stage": stage,  # device-seconds per stage over the kind's seconds: devices busy on average
        "bound_by": STAGES[int(np.argmax(kind.stage_s))],
        "tail_s_per_gemm": kind.tail_s / kind.tailed if kind.tailed else None,
        "copied": kind.copied, "duplicates": kind.duplicates,
        **strips_over_cache(sim, shape),
        **planned(sim, shape),
    }


def _fleet_flops(sim: Simulation) -> float:
    return float(sim.world.actual.flops[sim.scheduler.plans[0].members].sum())


def breakdown(sim: Simulation, tally: Tally, stats: StepStats) -> dict[str, Any]:
    """The step's account (see the module docstring), from a `Tally` that watched `sim.step(tally)`."""
    step_s = stats.step_s
    used = np.flatnonzero(tally.stage_s.max(axis=1) > 0)
    per = tally.stage_s[used]
    bound = np.argmax(per, axis=1)
    flops = sum(2.0 * k.m * k.n * k.k * k.count for k in tally.kinds.values())
    distinct = sum((k.m + k.n) * k.k * sim.dtype_bytes * k.count for k in tally.kinds.values())
    kinds = {name: _kind_json(sim, name, k, step_s) for name, k in tally.kinds.items()}
    return {
        "step_s": step_s,
        **{f: sum(k[f] for k in kinds.values()) for f in ("planned_s", "lower_bound_s", "device_bound_s", "dealt_s")},
        "devices_used": len(used),
        "compute_floor_s": flops / _fleet_flops(sim),
        "ps_egress_floor_s": distinct / sim.ps_bandwidth if sim.ps_bandwidth else 0.0,
        "ps_bytes": stats.ps_bytes,
        "distinct_input_bytes": float(distinct),
        "devices_bound_by": {s: int(np.count_nonzero(bound == i)) for i, s in enumerate(STAGES)},
        "device_busy_share": dict(zip(STAGES, (per.mean(axis=0) / step_s).tolist(), strict=True)),
        "device_idle_share": float(1.0 - (per.max(axis=1) / step_s).mean()),
        "busiest_device_s": float(per.max()),  # its busiest stage's seconds: no order of these bytes beats it
        "copied": stats.copied, "duplicates": stats.duplicates,
        "kinds": kinds,
    }


def step_breakdown(sim: Simulation) -> dict[str, Any]:
    """Run one step of `sim` and account where its time went."""
    tally = Tally(sim)
    stats = sim.step(tally)
    return breakdown(sim, tally, stats)
