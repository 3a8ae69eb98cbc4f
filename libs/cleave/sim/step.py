"""Training steps over a simulated fleet: every GEMM of a step as the PS runs them, each dealt by the PS's
dealing core (`cleave.gemm.engine`) under the latest plan (`cleave.sim.plans`): one after another, or with
`deferred` > 0 the backward's weight gradients dealt beside the input gradients as the PS's `deferred_gemms`
does (`Simulation._backward`).

A GEMM that nothing disturbs (no device of its plan leaves or is busy from before, no plan arrives, nobody
is suspect) costs what the same GEMM cost last time under the same plan, so it is simulated once and then
reused; any other is simulated event by event. `simulate_step` is the entry point for comparing with a
measured step; `Simulation` runs steps with churn and stragglers (`cleave sim`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from cleave.gemm.dealer import DEFAULT_CACHE_BYTES, Dealer, Instruction, Policy, Recovery, Send
from cleave.gemm.engine import Engine, OneGemm, Outcome, PsLink, TileSet, fleet_of
from cleave.gemm.tiles import DEFAULT_CHUNKS, DEFAULT_TILE
from cleave.models import GemmShape, backward_pairs, is_backward, step_order
from cleave.plan.fleet import Fleet
from cleave.schemas import DeviceProfile
from cleave.sim.plans import Cutter, PlannerKind, PlanTimeline
from cleave.sim.world import World

HORIZON_FACTOR = 10.0  # churn is drawn this many predicted GEMM spans ahead ...
HORIZON_MIN_S = 60.0  # ... and at least this far


@dataclass
class StepStats:
    """One simulated step: its time and what the devices and the ledger did."""

    step_s: float
    down: dict[int, float]  # bytes per device number
    up: dict[int, float]
    tiles: int = 0
    resent: int = 0
    duplicates: int = 0
    copied: int = 0
    gemms_simulated: int = 0  # event by event (the rest reused an undisturbed GEMM's cost)
    flops: float = 0.0  # of the accepted tiles
    ps_bytes: float = 0.0  # what the PS sent (tiles, and fan-out blocks once per group)
    recoveries: list[Recovery] = field(default_factory=list)

    def add(self, out: Outcome) -> None:
        for mine, theirs in ((self.down, out.down), (self.up, out.up)):
            for d, v in theirs.items():
                mine[d] = mine.get(d, 0.0) + v
        self.tiles += out.tiles
        self.resent += out.resent
        self.duplicates += out.duplicates
        self.copied += out.copied
        self.flops += out.flops
        self.ps_bytes += out.ps_bytes
        self.recoveries += out.recoveries


@dataclass
class Simulation:
    """Steps of one job on one world; state (plans, the PS's worker slots, busy devices) carries over."""

    world: World
    shapes: Sequence[GemmShape]
    dtype_bytes: int
    planner: PlannerKind = "cost"
    tile: tuple[int, int] | None = None
    ps_bandwidth: float | None = None
    policy: Policy = field(default_factory=Policy)
    liveness_s: float = 1.0
    replan_every_s: float = 0.0
    plan_delay_s: float = 1.0
    chunks: int = DEFAULT_CHUNKS  # a planned block goes out in at least this many pieces (`tiles.cut_block`)
    cache_bytes: int = DEFAULT_CACHE_BYTES  # each worker's input-block cache, mirrored by the PS
    fan_out: bool = True  # shared blocks published once to their group (the PS's `fanout` setting)
    # the PS's `deferred_gemms`: weight gradients dealt beside the backward's input gradients, at most this many
    # waiting; 0 (the simulator's default, unlike the PS's 8): one GEMM at a time, and every undisturbed GEMM
    # simulated once and reused; with deferral every backward GEMM is simulated event by event (slower)
    deferred: int = 0
    now: float = 0.0

    def __post_init__(self) -> None:
        self.scheduler = PlanTimeline(self.world, self.liveness_s, self.replan_every_s, self.plan_delay_s)
        self.cutter = Cutter(self.world, self.dtype_bytes, self.planner, self.tile, self.chunks, self.ps_bandwidth,
                             self.policy.window, self.cache_bytes)
        self.version = 0
        self.dealer = Dealer(self.policy)  # the PS's dealing core, members and all, from GEMM to GEMM
        self._profiles: dict[int, DeviceProfile] = {}
        self.carry = self._notes(self.dealer.set_fleet(self.fleet(self.scheduler.plans[0].ids(self.world)), 0.0))
        self.seq = 0
        self.link = PsLink(self.ps_bandwidth)  # the PS's egress, busy from GEMM to GEMM
        self.busy = np.zeros((len(self.world), 3))  # per device: downlink, compute, uplink next free
        self.clean: dict[tuple, Outcome] = {}
        self.order = step_order(self.shapes)
        self.forward = [i for i in self.order if not is_backward(self.shapes[i])]
        self.pairs = backward_pairs(self.shapes, self.order)

    def fleet(self, ids: Sequence[str]) -> list[tuple[str, int, DeviceProfile]]:
        return fleet_of(ids, self.world.index, self.world.declared, self.cache_bytes, self._profiles)

    def _advance(self, until: float) -> None:
        self.world.churn(until)
        self.scheduler.extend(until)
        if len(self.busy) < len(self.world):
            self.busy = np.concatenate([self.busy, np.zeros((len(self.world) - len(self.busy), 3))])

    def _apply_ready_plans(self) -> None:
        """Plans that reached the PS between GEMMs (`Dispatcher.set_plan` with no GEMM in flight)."""
        plans = self.scheduler.plans
        while self.version + 1 < len(plans) and plans[self.version + 1].ready_at <= self.now:
            self.version += 1
            self.carry += self._notes(self.dealer.set_fleet(self.fleet(plans[self.version].ids(self.world)), self.now))

    @staticmethod
    def _notes(instructions: list[Instruction]) -> list[Instruction]:
        """What the dealer decided between GEMMs besides sends (none: nothing is in flight), for the next
        engine to carry out (link checks of returning devices)."""
        return [i for i in instructions if not isinstance(i, Send)]

    def _carried(self) -> list[Instruction]:
        carry, self.carry = self.carry, []
        return carry

    def _undisturbed(self, span: float, members: np.ndarray) -> bool:
        end = self.now + span
        plans = self.scheduler.plans
        if self.version + 1 < len(plans) and plans[self.version + 1].ready_at <= end:
            return False
        members_now = self.dealer.members
        if any(m.suspect for m in members_now.values()) or len(members_now) != len(members):
            return False
        return bool(self.world.leave_at[members].min() > end and self.busy[members].max() <= self.now
                    and self.link.free_at <= self.now)

    def gemm(self, shape: GemmShape) -> tuple[Outcome, bool]:
        """Run one GEMM now; (its outcome, whether it was simulated event by event)."""
        self._advance(self.now + HORIZON_MIN_S)
        self._apply_ready_plans()
        plan = self.scheduler.plans[self.version]
        laid = self.scheduler.plans[plan.layout]
        ts, predicted = self.cutter.tileset(plan.layout, laid, shape.m, shape.n, shape.k)
        key = (self.version, shape.m, shape.n, shape.k)
        known = self.clean.get(key)
        guess = known.span if known else (predicted if math.isfinite(predicted) else HORIZON_MIN_S)
        self._advance(self.now + max(HORIZON_FACTOR * guess, HORIZON_MIN_S))
        if known is not None and self._undisturbed(known.span, plan.members):
            self.link.sent += known.ps_bytes
            if self.link.bandwidth:
                self.link.free_at = self.now + known.ps_busy_s
            return Outcome(
                self.now,
                self.now + known.span,
                known.down,
                known.up,
                known.tiles,
                0,
                0,
                known.copied,
                [],
                0,
                flops=known.flops,
                ps_bytes=known.ps_bytes,
                ps_busy_s=known.ps_busy_s,
            ), False
        later = [(p.ready_at, p.ids(self.world)) for p in self.scheduler.plans[self.version + 1 :]]
        undisturbed = self._undisturbed(0.0, plan.members)
        self.seq += 1
        run = OneGemm(ts, self.now, self.dealer, self.world.index, self.world.actual, self.world.leave_at,
                      self.busy, self.fleet, self.seq, later, self.link, self.fan_out, self._carried())
        out = run.run()
        self.version += out.plans_applied
        if (
            undisturbed
            and not out.plans_applied
            and not out.recoveries
            and self.world.leave_at[plan.members].min() > out.end
        ):
            self.clean[key] = out
        return out, True

    def step(self, on_gemm: Callable[[GemmShape, Outcome, bool], None] | None = None) -> StepStats:
        """One training step: every GEMM in order (`on_gemm` sees each one's outcome, and whether it was
        simulated event by event: `cleave.sim.breakdown` accounts the step with it)."""
        start = self.now
        stats = StepStats(0.0, {}, {})

        def seen(shape: GemmShape, out: Outcome, simulated: bool) -> None:
            if on_gemm is not None:
                on_gemm(shape, out, simulated)
            stats.add(out)
            stats.gemms_simulated += simulated

        for i in self.forward if self.deferred else self.order:
            out, simulated = self.gemm(self.shapes[i])
            seen(self.shapes[i], out, simulated)
            self.now = out.end
        if self.deferred:
            self._backward(seen)
        stats.step_s = self.now - start
        return stats

    def _backward(self, seen: Callable[[GemmShape, Outcome, bool], None]) -> None:
        """The backward pass as the PS runs it with `deferred_gemms` (`cleave.gemm.tiled.LateGrads`): per layer its
        input gradient (priority 0) and its weight gradient (priority 1) begin together; the pass waits for
        the input gradient only, and for the oldest weight gradient when more than `deferred` wait; every
        one is done when the pass ends. All on one `Engine`, each GEMM cut under the plan in force when it
        begins; plans that arrive meanwhile apply when they do."""
        self._advance(self.now + HORIZON_MIN_S)
        self._apply_ready_plans()
        base, plans = self.version, self.scheduler.plans
        eng = Engine(self.now, self.dealer, self.world.index, self.world.actual, self.world.leave_at, self.busy,
                     self.fleet, [(p.ready_at, p.ids(self.world)) for p in plans[base + 1 :]], self.link,
                     self.fan_out, self._carried())
        begun: list[tuple[int, GemmShape]] = []
        waiting: deque[int] = deque()
        for dx, dw in self.pairs:
            seqs = []
            for i, priority in ((dx, 0), (dw, 1)):
                if i is None:
                    continue
                shape = self.shapes[i]
                plan = plans[base + eng.plans_applied]
                ts, predicted = self.cutter.tileset(plan.layout, plans[plan.layout], shape.m, shape.n, shape.k)
                known = len(plans)
                self._advance(eng.now + max(HORIZON_FACTOR * (predicted if math.isfinite(predicted) else 0.0),
                                            HORIZON_MIN_S))
                eng.leave_at, eng.busy = self.world.leave_at, self.busy  # (grown with the world)
                eng.add_plans([(p.ready_at, p.ids(self.world)) for p in plans[known:]])
                self.seq += 1
                eng.begin(ts, self.seq, priority)
                begun.append((self.seq, shape))
                seqs.append(self.seq)
            if dw is not None:
                waiting.append(seqs[-1])
            while len(waiting) > self.deferred:
                eng.run_until([waiting.popleft()])
            if dx is not None:
                eng.run_until(seqs[:1])
        eng.run_until(list(waiting))
        self.version = base + eng.plans_applied
        self.now = eng.now
        for seq, shape in begun:
            seen(shape, eng.outcomes[seq], True)


def world_of(fleet_profiles: Mapping[str, DeviceProfile] | Fleet) -> World:
    return World.build(Fleet.of(fleet_profiles))


def simulate_step(
    fleet_profiles: Mapping[str, DeviceProfile] | Fleet,
    shapes: Sequence[GemmShape],
    dtype_bytes: int,
    *,
    planner: PlannerKind = "cost",
    tile_rows: int | None = DEFAULT_TILE,
    tile_cols: int | None = DEFAULT_TILE,
    chunks: int = DEFAULT_CHUNKS,
    ps_bandwidth: float | None = None,
    policy: Policy | None = None,
    steps: int = 1,
    ps_overhead_s: float = 0.0,
) -> float:
    """Seconds of one training step's GEMMs on this fleet, as the simulator predicts them, plus
    `ps_overhead_s` (the PS's own work per step, which the simulator does not model).

    The defaults are the running stack's: the scheduler's cost-aware plan, blocks cut into tiles of at most
    1024 x 1024 and at least 4 pieces a block, the PS's window, deadlines and speculation (`Policy()`). With `steps` > 1, the last step's
    time (the PS's round-trip averages warmed up)."""
    tile = (tile_rows, tile_cols) if tile_rows and tile_cols else None
    sim = Simulation(
        world_of(fleet_profiles), list(shapes), dtype_bytes, planner, tile, ps_bandwidth, policy or Policy(),
        chunks=chunks,
    )
    last = 0.0
    for _ in range(max(1, steps)):
        last = sim.step().step_s
    return last + ps_overhead_s


def busiest(world: World, ts: TileSet) -> str:
    """The device (not a straggler, unless every owner is one) with the most planned output area in this GEMM."""
    area: dict[str, int] = {}
    for t, o in zip(ts.tiles, ts.owners, strict=True):
        if o is not None:
            area[o] = area.get(o, 0) + t.rows * t.cols
    fit = [w for w in area if not world.straggler[world.index[w]]] or list(area)
    return max(fit, key=lambda w: area[w])


@dataclass(frozen=True)
class Loss:
    """One device lost in one GEMM (`recovery_after_loss`)."""

    gemm: str
    tiles_lost: int
    recovery_s: float  # from the loss until its unfinished tiles are done again, noticing included
    detect_s: float | None  # from the loss until the PS gave its tiles back (None: a copy won first)
    gemm_delay_s: float  # what the loss added to the GEMM's span
    gemm_s: float  # the GEMM's span without the loss


def recovery_after_loss(sim: Simulation, shape: GemmShape, at_fraction: float = 0.5) -> Loss:
    """Lose the device with the most planned work halfway through its part of one GEMM (nothing else
    leaves): how long until its unfinished tiles are done again, noticing included (by deadline or the
    next plan, or sooner when an idle worker's speculative copy wins)."""
    world = sim.world
    plan = sim.scheduler.plans[0]
    ts, _ = sim.cutter.tileset(0, plan, shape.m, shape.n, shape.k)
    ids = plan.ids(world)

    def run(leave_at: np.ndarray, plans: list) -> Outcome:
        dealer = Dealer(sim.policy)
        dealer.set_fleet(sim.fleet(ids), 0.0)
        busy = np.zeros((len(world), 3))
        return OneGemm(ts, 0.0, dealer, world.index, world.actual, leave_at, busy, sim.fleet, 1, plans,
                       PsLink(sim.ps_bandwidth), sim.fan_out).run()

    stay = np.full(len(world), math.inf)
    clean = run(stay, [])
    victim = busiest(world, ts)
    leave = at_fraction * clean.last[world.index[victim]]
    stay[world.index[victim]] = leave
    out = run(stay, [(leave + sim.liveness_s + sim.plan_delay_s, tuple(w for w in ids if w != victim))])
    lost = [i for i, o in enumerate(ts.owners) if o == victim and clean.accepted_at[i] > leave]
    rec = next((r for r in out.recoveries if r.worker == victim), None)
    return Loss(
        shape.name,
        len(lost),
        float(max((out.accepted_at[i] - leave for i in lost), default=0.0)),
        None if rec is None else float(rec.detected_at - leave),
        float(out.span - clean.span),
        float(clean.span),
    )


def recovery_over_step(sim: Simulation, shapes: Sequence[GemmShape]) -> dict[str, Any]:
    """`recovery_after_loss` in every GEMM kind of a step: `recovery_s` is their mean weighted by the time
    the step spends in each kind (a device fails at a random moment), `worst_s` the slowest kind's (usually a
    weight-gradient GEMM: its blocks go whole, their inputs being k = tokens long)."""
    kinds: dict[tuple[int, int, int], tuple[GemmShape, int]] = {}
    for s in shapes:
        first, count = kinds.get((s.m, s.n, s.k), (s, 0))
        kinds[(s.m, s.n, s.k)] = (first, count + s.count_per_step)
    losses = [(recovery_after_loss(sim, s), count) for s, count in kinds.values()]
    weight = sum(r.gemm_s * count for r, count in losses)
    worst = max((r for r, _ in losses), key=lambda r: r.recovery_s)
    return {
        "recovery_s": sum(r.recovery_s * r.gemm_s * count for r, count in losses) / weight,
        "worst_s": worst.recovery_s,
        "worst": asdict(worst),
        "per_gemm": {r.gemm: r.recovery_s for r, _ in losses},
    }
