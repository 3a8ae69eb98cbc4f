"""What the scheduler and the PS know: the plans published as the fleet changes, and each GEMM cut into the
tiles the PS deals (pure: the planner of `cleave.plan.planner`, no NATS).

The scheduler notices a join at once and a leave `liveness_s` after it happens. It publishes a plan for
every change (changes that come while one is being made wait for the next), and each reaches the PS
`plan_delay_s` after it was begun. A plan's workers are always the fleet of its time; its *layout* (the
planner's blocks) is recomputed for every plan, as the scheduler does today, or with `replan_every_s` > 0
at most that often and otherwise kept from the previous plan (a cheaper policy for very large fleets: a
leaver's blocks then go to the shared queue, and a joiner takes shared tiles until the next layout).

The PS cuts each GEMM by the latest plan it holds when the GEMM starts, as `cleave_ps.fleet.dispatcher` does:
the planned blocks (cut by `tiles.cut_block`: to at most `tile` rows x columns when set, and into at least
`chunks` pieces), each owned by its planned device if that device is still a worker, else by nobody.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from cleave.gemm import predict, tiles
from cleave.gemm.engine import TileSet
from cleave.gemm.ledger import DEFAULT_WINDOW
from cleave.plan import planner
from cleave.plan.costmodel import egress_bytes
from cleave.sim.world import World

PlannerKind = Literal["cost", "even", "uniform"]


@dataclass(frozen=True)
class PublishedPlan:
    """One published plan: its devices (numbers into the world, in plan order) and when the PS has it."""

    ready_at: float
    members: np.ndarray
    layout: int = 0  # the plan whose blocks this one uses (itself, or an earlier one)

    def ids(self, world: World) -> tuple[str, ...]:
        return tuple(world.ids[i] for i in self.members.tolist())


@dataclass
class PlanTimeline:
    """Plans over time, derived from the world's joins and leaves (see the module docstring)."""

    world: World
    liveness_s: float = 1.0
    replan_every_s: float = 0.0  # 0: a fresh layout with every plan
    plan_delay_s: float = 1.0
    plans: list[PublishedPlan] = field(default_factory=list)
    made_at: float = 0.0  # when the latest plan was begun (the first one is there at the start)
    laid_at: float = 0.0  # ... and the latest layout

    def __post_init__(self) -> None:
        self.plans = [PublishedPlan(0.0, self.world.alive(0.0))]

    def extend(self, until: float) -> None:
        """Make every plan begun by `until` (the world must be churned up to `until`)."""
        w = self.world
        joins = w.join_at[w.join_at > 0]
        leaves = w.leave_at[np.isfinite(w.leave_at)] + self.liveness_s
        changes = np.concatenate([joins, leaves])
        while True:
            later = changes[changes > self.made_at]
            if not len(later):
                return
            begin = max(float(later.min()), self.made_at + self.plan_delay_s)
            if begin > until:
                return
            members = np.flatnonzero((w.join_at <= begin) & (w.leave_at + self.liveness_s > begin))
            layout = self.plans[-1].layout
            if begin >= self.laid_at + self.replan_every_s:
                layout, self.laid_at = len(self.plans), begin
            self.plans.append(PublishedPlan(begin + self.plan_delay_s, members, layout))
            self.made_at = begin


@dataclass
class Cutter:
    """Each GEMM of a plan as the PS cuts it into tiles, cached per (plan, shape)."""

    world: World
    dtype_bytes: int
    kind: PlannerKind = "cost"
    tile: tuple[int, int] | None = None  # cut planned blocks to at most this; None = no largest tile
    chunks: int = tiles.DEFAULT_CHUNKS  # ... and into at least this many pieces (`tiles.cut_block`)
    ps_bandwidth: float | None = None
    window: int = DEFAULT_WINDOW  # the PS's tiles in flight per worker (for the prediction)
    cache_bytes: int = predict.UNLIMITED  # the workers' block cache (pieces stream only where it holds inputs)
    cache: dict[tuple, tuple[TileSet, float]] = field(default_factory=dict)
    gemm_plans: dict[tuple, Any] = field(default_factory=dict)
    dealt: dict[tuple, float] = field(default_factory=dict)  # the fleet's part of each prediction (no egress)
    streamed: dict[tuple, float] = field(default_factory=dict)  # ... each device streaming its own blocks alone

    def tileset(self, version: int, plan: PublishedPlan, m: int, n: int, k: int) -> tuple[TileSet, float]:
        """(the tiles, the predicted makespan) of C[m, n] = A[m, k] · B[k, n] under the layout `version`
        (`plan` is that layout's own plan); the prediction is `cleave.gemm.predict.dealt_makespan`: the planner's
        blocks as the PS's dealer deals them to devices that stream them, this GEMM kind alone (the scheduler's
        `step_makespans` deals a step of one layer, so the dealer's state carries across kinds), or the
        PS's egress if longer."""
        key = (version, m, n, k)
        if key not in self.cache:
            self.cache[key] = self._cut(version, plan, m, n, k)
        return self.cache[key]

    def _cut(self, version: int, plan: PublishedPlan, m: int, n: int, k: int) -> tuple[TileSet, float]:
        b, ids = self.dtype_bytes, plan.ids(self.world)
        if self.kind == "uniform":
            rows, cols = tiles.uniform_block(m, n, self.tile or (tiles.DEFAULT_TILE, tiles.DEFAULT_TILE), len(ids))
            grid = tiles.grid(m, n, rows, cols)
            egress = egress_bytes(m, n, k, b) / self.ps_bandwidth if self.ps_bandwidth else 0.0
            return TileSet(m, n, k, b, grid, [None] * len(grid), egress), math.nan
        gp = self.gemm_plan(version, plan, m, n, k)
        r0, r1, c0, c1 = (
            (gp.row0, gp.row1, gp.col0, gp.col1) if m <= n else (gp.col0, gp.col1, gp.row0, gp.row1)
        )
        blocks = list(zip(r0.tolist(), r1.tolist(), c0.tolist(), c1.tolist(), strict=True))
        planned = [ids[d] for d in gp.dev.tolist()]
        boxes: list[tuple[int, int, int, int]] = []
        owners: list[str | None] = []
        limit = self.tile or (m, n)
        for owner, box in zip(planned, blocks, strict=True):
            parts = tiles.cut_planned(box, k, b, *limit, self.chunks, self.cache_bytes)
            boxes += parts
            owners += [owner] * len(parts)
        cut = tiles.from_boxes(boxes)
        fleet = self.world.fleet(plan.members)
        profiles = {dev.id: dev.profile for dev in fleet.devices()}
        dealt = predict.dealt_makespan(blocks, planned, profiles, k, b, *limit, self.chunks, self.window,
                                       dict.fromkeys(profiles, self.cache_bytes))
        self.dealt[(version, m, n, k)] = dealt
        self.streamed[(version, m, n, k)] = predict.streamed_makespan(
            blocks, planned, profiles, k, b, *limit, self.chunks, self.window, dict.fromkeys(profiles, self.cache_bytes))
        return TileSet(m, n, k, b, cut, owners, gp.egress_s, self.chunks), max(dealt, gp.egress_s)

    def gemm_plan(self, version: int, plan: PublishedPlan, m: int, n: int, k: int) -> planner.GemmPlan:
        """The planner's plan of the GEMM in its canonical orientation (rows = the shorter side): a GEMM and
        its transpose share one, as in `plan_model`."""
        key = (version, min(m, n), max(m, n), k)
        if key not in self.gemm_plans:
            make = planner.plan_gemm if self.kind == "cost" else planner.even_split
            self.gemm_plans[key] = make(
                self.world.fleet(plan.members), min(m, n), max(m, n), k, self.dtype_bytes, self.ps_bandwidth
            )
        return self.gemm_plans[key]
