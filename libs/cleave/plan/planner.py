"""The planner: for every GEMM of a training step, the devices that take part and the output blocks each
computes, with the predicted makespan and a lower bound on it (pure: no NATS, no I/O).

`plan_gemm` plans one GEMM (what the PS calls at run time); `plan_model` plans every GEMM kind of a step
and reports the predicted step time against the lower bound; `even_split` is the naive baseline (every
device, equal blocks). The cost model and bounds live in `cleave.plan.costmodel`, the packing in
`cleave.plan.packing`; docs/planning.md describes all three and the JSON of `ModelPlan.to_json`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple, Protocol

import numpy as np

from cleave.errors import PlanError
from cleave.plan.costmodel import GemmBound, Rates, egress_bytes, gemm_bound, tile_memory_bytes, tile_time
from cleave.plan.fleet import Fleet, FleetLike
from cleave.plan.packing import Blocks, solve

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}

__all__ = [
    "DTYPE_BYTES",
    "Assignment",
    "GemmPlan",
    "GemmKind",
    "ModelPlan",
    "PlanError",
    "even_split",
    "even_split_model",
    "plan_gemm",
    "plan_model",
]


class GemmKind(Protocol):
    """What the planner reads of a GEMM kind (`cleave.models.GemmShape` has it)."""

    name: str
    m: int
    n: int
    k: int
    count_per_step: int


class _Shape(NamedTuple):
    name: str
    m: int
    n: int
    k: int
    count_per_step: int


class Assignment(NamedTuple):
    """Device `device` computes output rows row0:row1 and columns col0:col1 (half-open)."""

    device: str
    row0: int
    row1: int
    col0: int
    col1: int


@dataclass(frozen=True, eq=False)
class GemmPlan:
    """The plan of one GEMM kind C[m, n] = A[m, k] · B[k, n]: blocks as parallel arrays, and its costs."""

    name: str
    m: int
    n: int
    k: int
    count_per_step: int
    dtype_bytes: int
    device_ids: tuple[str, ...]  # the fleet's ids; `dev` indexes into it
    dev: np.ndarray
    row0: np.ndarray
    row1: np.ndarray
    col0: np.ndarray
    col1: np.ndarray
    block_time_s: np.ndarray  # predicted seconds per block (for speculative re-sends)
    device_time_s: float  # the busiest device's predicted total
    egress_s: float  # the PS's egress time for (m + n)·k·b bytes
    bound: GemmBound

    @property
    def makespan_s(self) -> float:
        return max(self.device_time_s, self.egress_s)

    @property
    def lower_bound_s(self) -> float:
        return self.bound.value

    @property
    def gap(self) -> float:
        """Makespan over the lower bound, minus one."""
        return self.makespan_s / self.lower_bound_s - 1

    @cached_property
    def devices_used(self) -> int:
        return int(len(np.unique(self.dev)))

    @property
    def ps_egress_bytes(self) -> int:
        return egress_bytes(self.m, self.n, self.k, self.dtype_bytes)

    @cached_property
    def assignments(self) -> list[Assignment]:
        ids = self.device_ids
        cols = (
            self.dev.tolist(),
            self.row0.tolist(),
            self.row1.tolist(),
            self.col0.tolist(),
            self.col1.tolist(),
        )
        return [Assignment(ids[d], r0, r1, c0, c1) for d, r0, r1, c0, c1 in zip(*cols, strict=True)]

    def to_dict(self, assignments: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "m": self.m,
            "n": self.n,
            "k": self.k,
            "count_per_step": self.count_per_step,
            "makespan_s": self.makespan_s,
            "lower_bound_s": self.lower_bound_s,
            "gap": self.gap,
            "device_time_s": self.device_time_s,
            "ps_egress_s": self.egress_s,
            "ps_egress_bytes": self.ps_egress_bytes,
            "devices_used": self.devices_used,
            "blocks": len(self.dev),
        }
        if assignments:
            out["assignments"] = [a._asdict() for a in self.assignments]
        return out


@dataclass(frozen=True, eq=False)
class ModelPlan:
    """Plans of every GEMM kind of one training step; step time = sum of makespan x count_per_step."""

    gemms: tuple[GemmPlan, ...]
    plan_time_s: float  # wall-clock seconds plan_model took
    plan_cpu_s: float  # CPU seconds of this process (what other processes' load does not inflate)
    n_devices: int
    dtype_bytes: int
    ps_bandwidth: float | None

    @property
    def predicted_step_s(self) -> float:
        return sum(g.makespan_s * g.count_per_step for g in self.gemms)

    @property
    def lower_bound_s(self) -> float:
        return sum(g.lower_bound_s * g.count_per_step for g in self.gemms)

    @property
    def gap(self) -> float:
        return self.predicted_step_s / self.lower_bound_s - 1

    @cached_property
    def devices_used(self) -> int:
        return int(len(np.unique(np.concatenate([g.dev for g in self.gemms])))) if self.gemms else 0

    def to_dict(self, assignments: bool = True) -> dict[str, Any]:
        return {
            "plan_time_s": self.plan_time_s,
            "plan_cpu_s": self.plan_cpu_s,
            "predicted_step_s": self.predicted_step_s,
            "lower_bound_s": self.lower_bound_s,
            "gap": self.gap,
            "devices_used": self.devices_used,
            "devices_total": self.n_devices,
            "dtype_bytes": self.dtype_bytes,
            "ps_bandwidth": self.ps_bandwidth,
            "max_gemm_gap": max((g.gap for g in self.gemms), default=0.0),
            "gemms": [g.to_dict(assignments) for g in self.gemms],
        }

    def to_json(self, assignments: bool = True, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(assignments), indent=indent)


def _check(fleet: Fleet, m: int, n: int, k: int, b: int, ps_bandwidth: float | None, name: str,
           mem_b: int) -> None:
    if len(fleet) == 0:
        raise PlanError("the fleet is empty: no device to plan on")
    if min(m, n, k) < 1:
        raise PlanError(f"GEMM {name}: m, n, k must be positive, got {m}x{n}x{k}")
    for what, v in (("dtype_bytes", b), ("memory_dtype_bytes", mem_b)):
        if v not in (1, 2, 4, 8):
            raise PlanError(f"{what} must be 1, 2, 4 or 8, got {v}")
    if ps_bandwidth is not None and not ps_bandwidth > 0:
        raise PlanError(f"ps_bandwidth must be positive bytes/s or None (unlimited), got {ps_bandwidth}")
    need = (2 * k + 1) * mem_b
    if int(fleet.memory_bytes.max()) < need:
        raise PlanError(
            f"GEMM {name} ({m}x{n}, k={k}, {mem_b} B/element in memory) needs {need} bytes for its smallest "
            f"tile (1x1); the largest device memory is {int(fleet.memory_bytes.max())} bytes"
        )


def _gemm_plan(fleet: Fleet, shape: GemmKind, b: int, blocks: Blocks, bound: GemmBound) -> GemmPlan:
    rows_a = shape.m <= shape.n  # the shorter side is the rows
    r0, r1, c0, c1 = (
        (blocks.a0, blocks.a1, blocks.b0, blocks.b1)
        if rows_a
        else (blocks.b0, blocks.b1, blocks.a0, blocks.a1)
    )
    return GemmPlan(
        shape.name,
        shape.m,
        shape.n,
        shape.k,
        shape.count_per_step,
        b,
        fleet.ids,
        blocks.dev,
        r0,
        r1,
        c0,
        c1,
        blocks.time_s,
        blocks.device_time_s,
        bound.egress_s,
        bound,
    )


def _plan_shapes(
    fleet: Fleet, shapes: Sequence[GemmKind], b: int, ps_bandwidth: float | None, mem_b: int | None = None
) -> list[GemmPlan]:
    cache: dict[tuple[int, int, int], tuple[Blocks, GemmBound]] = {}
    rates: dict[int, Rates] = {}
    plans = []
    for s in shapes:
        _check(fleet, s.m, s.n, s.k, b, ps_bandwidth, s.name, mem_b or b)
        key = (min(s.m, s.n), max(s.m, s.n), s.k)
        if key not in cache:
            r = rates.setdefault(s.k, Rates.of(fleet, s.k, b, mem_b))
            bound = gemm_bound(fleet, r, s.m, s.n, b, ps_bandwidth)
            cache[key] = (solve(r, key[0], key[1], bound.devices_s), bound)
        plans.append(_gemm_plan(fleet, s, b, *cache[key]))
    return plans


def plan_gemm(
    devices: FleetLike,
    m: int,
    n: int,
    k: int,
    dtype_bytes: int,
    ps_bandwidth: float | None = None,
    *,
    name: str = "gemm",
    count_per_step: int = 1,
) -> GemmPlan:
    """Plan C[m, n] = A[m, k] · B[k, n] on these devices; blocks tile [0, m) x [0, n) exactly."""
    shape = _Shape(name, m, n, k, count_per_step)
    return _plan_shapes(Fleet.of(devices), [shape], dtype_bytes, ps_bandwidth)[0]


def plan_model(
    devices: FleetLike, shapes: Sequence[GemmKind], dtype_bytes: int, ps_bandwidth: float | None = None,
    memory_dtype_bytes: int | None = None,
) -> ModelPlan:
    """Plan every GEMM kind of a step (`cleave.models.gemm_shapes`); kinds of one shape share a plan.
    `dtype_bytes` is what an element takes on the links, `memory_dtype_bytes` in a device's memory (default:
    the same)."""
    start, cpu = time.perf_counter(), time.process_time()
    fleet = Fleet.of(devices)
    if len(fleet) == 0:
        raise PlanError("the fleet is empty: no device to plan on")
    plans = _plan_shapes(fleet, shapes, dtype_bytes, ps_bandwidth, memory_dtype_bytes)
    return ModelPlan(
        tuple(plans),
        time.perf_counter() - start,
        time.process_time() - cpu,
        len(fleet),
        dtype_bytes,
        ps_bandwidth,
    )


def _even_blocks(m: int, n: int, count: int) -> tuple[np.ndarray, ...]:
    """`count` nearly equal blocks: g row groups of even height, each cut into q or q+1 even columns."""
    g = int(np.clip(round(np.sqrt(count * m / n)), 1, min(m, count)))
    per = np.full(g, count // g, dtype=np.int64)
    per[: count % g] += 1
    per = np.minimum(per, n)
    edges = np.arange(g + 1, dtype=np.int64) * m // g
    grp = np.repeat(np.arange(g), per)
    idx = np.arange(len(grp)) - np.repeat(np.cumsum(per) - per, per)
    c0, c1 = idx * n // per[grp], (idx + 1) * n // per[grp]
    return edges[grp], edges[grp + 1], c0, c1


def _even(fleet: Fleet, shape: GemmKind, b: int, ps_bandwidth: float | None, mem_b: int | None = None) -> GemmPlan:
    mem_b = mem_b or b
    _check(fleet, shape.m, shape.n, shape.k, b, ps_bandwidth, shape.name, mem_b)
    r = Rates.of(fleet, shape.k, b, mem_b)
    bound = gemm_bound(fleet, r, shape.m, shape.n, b, ps_bandwidth)
    # every device that can hold a 1x1 tile, in fleet order, with more rounds until all blocks fit
    able = np.flatnonzero(fleet.memory_bytes >= (2 * shape.k + 1) * mem_b)
    rounds = 1
    while True:
        count = min(len(able) * rounds, shape.m * shape.n)
        r0, r1, c0, c1 = _even_blocks(shape.m, shape.n, count)
        dev = able[np.arange(len(r0)) % len(able)]
        if (
            np.all(tile_memory_bytes(r1 - r0, c1 - c0, shape.k, mem_b) <= fleet.memory_bytes[dev])
            or count == shape.m * shape.n
        ):
            break
        rounds *= 2
    t = tile_time(r, dev, r1 - r0, c1 - c0)
    busiest = float(np.bincount(dev, weights=t, minlength=len(fleet)).max())
    return GemmPlan(
        shape.name,
        shape.m,
        shape.n,
        shape.k,
        shape.count_per_step,
        b,
        fleet.ids,
        dev,
        r0,
        r1,
        c0,
        c1,
        t,
        busiest,
        bound.egress_s,
        bound,
    )


def even_split(
    devices: FleetLike,
    m: int,
    n: int,
    k: int,
    dtype_bytes: int,
    ps_bandwidth: float | None = None,
    *,
    name: str = "gemm",
    count_per_step: int = 1,
) -> GemmPlan:
    """The naive baseline: every device (in fleet order) gets equal blocks, regardless of its profile (all
    in as many rounds as the smallest memory needs; devices that cannot hold even a 1x1 tile sit out)."""
    return _even(Fleet.of(devices), _Shape(name, m, n, k, count_per_step), dtype_bytes, ps_bandwidth)


def even_split_model(
    devices: FleetLike, shapes: Sequence[GemmKind], dtype_bytes: int, ps_bandwidth: float | None = None,
    memory_dtype_bytes: int | None = None,
) -> ModelPlan:
    """`even_split` for every GEMM kind of a step (`plan_model`'s bytes per element)."""
    start, cpu = time.perf_counter(), time.process_time()
    fleet = Fleet.of(devices)
    if len(fleet) == 0:
        raise PlanError("the fleet is empty: no device to plan on")
    plans = tuple(_even(fleet, s, dtype_bytes, ps_bandwidth, memory_dtype_bytes) for s in shapes)
    return ModelPlan(
        plans, time.perf_counter() - start, time.process_time() - cpu, len(fleet), dtype_bytes, ps_bandwidth
    )
