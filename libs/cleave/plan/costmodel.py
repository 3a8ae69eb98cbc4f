"""The cost of one tile on one device, and lower bounds on a GEMM's makespan (pure numpy, no I/O).

A tile is an output block of `r` rows and `c` columns of C[m, n] = A[m, k] · B[k, n]. Its device downloads
(r + c)·k·b bytes, uploads r·c·b bytes and does 2·r·c·k FLOPs; the three overlap (DESIGN.md section 5), so

    time   = latency + max((r + c)·k·b / downlink, r·c·b / uplink, 2·r·c·k / flops)
    memory = (r + c)·k·b + r·c·b  <=  memory_bytes

In the units of one GEMM (`Rates`): a device receives `lines` rows-or-columns of input per second and turns
out `area` output elements per second (the slower of its uplink and its compute), so a tile takes
`latency + max((r + c) / lines, r·c / area)`, and its memory in elements of b bytes is `(r + c)·k + r·c`.

The lower bound relaxes the planner's problem: each device may cover any real-valued area it could cover
within T on its own (one block, or several when memory forces it), ignoring integrality and the tiling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cleave.errors import PlanError
from cleave.plan.fleet import Fleet

BOUND_RTOL = 1e-6  # relative precision of the bisection behind the device lower bound
FLOOR_SLACK = 1e-6  # the bound rounds capacities down only past this much (the planner uses less)



@dataclass(frozen=True, eq=False)
class Rates:
    """A fleet's profiles in the units of one GEMM (inner dimension k, b bytes per element on the links;
    `mem_b` bytes per element in a device's memory, b unless the devices compute in another precision than
    the one that travels: a bf16 job's workers compute in float32)."""

    lat: np.ndarray  # seconds per tile
    lines: np.ndarray  # input rows + columns received per second: downlink / (k·b)
    area: np.ndarray  # output elements per second: min(uplink / b, flops / 2k)
    mem: np.ndarray  # int64 memory in elements: floor(memory_bytes / mem_b)
    k: int

    @classmethod
    def of(cls, fleet: Fleet, k: int, b: int, mem_b: int | None = None) -> Rates:
        area = np.minimum(fleet.uplink / b, fleet.flops / (2.0 * k))
        return cls(fleet.latency, fleet.downlink / (k * b), area, fleet.memory_bytes // (mem_b or b), k)

    def take(self, idx: np.ndarray) -> Rates:
        return Rates(self.lat[idx], self.lines[idx], self.area[idx], self.mem[idx], self.k)


@dataclass(frozen=True)
class GemmBound:
    """Lower bounds on one GEMM's makespan; `value` is the largest."""

    devices_s: float  # the area relaxation over the fleet's devices
    flops_s: float  # total FLOPs over the fleet's total FLOP/s
    egress_s: float  # (m + n)·k·b over the PS's egress bandwidth (0 when unlimited)

    @property
    def value(self) -> float:
        return max(self.devices_s, self.flops_s, self.egress_s)


def tile_time(r: Rates, dev: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Seconds each tile (rows x cols on device `dev`) takes under the cost model."""
    rows = rows.astype(np.float64)
    cols = cols.astype(np.float64)
    return r.lat[dev] + np.maximum((rows + cols) / r.lines[dev], rows * cols / r.area[dev])


def tile_memory_bytes(rows: np.ndarray, cols: np.ndarray, k: int, b: int) -> np.ndarray:
    """Bytes a tile occupies on its device: both input blocks and the output block."""
    rows = rows.astype(np.int64)
    cols = cols.astype(np.int64)
    return ((rows + cols) * k + rows * cols) * b


def egress_bytes(m: int, n: int, k: int, b: int) -> int:
    """The PS's egress for one GEMM when every row block of A and column block of B is published once."""
    return (m + n) * k * b


def max_cols(r: Rates, tau: np.ndarray, h: np.ndarray | int, cap: int) -> np.ndarray:
    """The widest block of `h` rows each device finishes within `tau` seconds after its latency (int64)."""
    h = np.asarray(h, dtype=np.int64)
    hf = h.astype(np.float64)
    width = np.minimum(tau * r.lines - hf, tau * r.area / hf)
    np.floor(width + 1e-9, out=width)
    np.minimum(width, (r.mem - h * r.k) // (r.k + h), out=width)
    np.clip(width, 0, cap, out=width)
    return width.astype(np.int64)


def ideal_side(r: Rates, tau: np.ndarray, cap: int) -> np.ndarray:
    """Side of the largest square block each device finishes within `tau` (real-valued, <= cap)."""
    by_mem = np.sqrt(float(r.k) ** 2 + r.mem) - r.k
    side = np.minimum(np.minimum(tau * r.lines / 2, np.sqrt(np.maximum(tau, 0) * r.area)), by_mem)
    return np.clip(side, 0, cap)


def box_area(sigma: np.ndarray, lo: int, hi: int, flat: bool = True) -> np.ndarray:
    """Largest r·c of integers with r + c = sigma (an integer), r <= lo, c <= hi (lo <= hi);
    `flat=False` drops the cap lo·hi (the result is then superadditive in sigma)."""
    if flat:
        sigma = np.minimum(sigma, lo + hi)  # the area is flat past lo + hi (and this keeps inf out)
    half = np.floor(sigma / 2)
    out = np.where(sigma <= 2 * lo, half * (sigma - half), lo * (sigma - lo))
    return np.minimum(out, float(lo) * hi) if flat else out


def _mem_sigma(r: Rates, lo: int, hi: int) -> np.ndarray:
    """The real r + c at which a block's memory stops it growing (inf where memory never binds in the box)."""
    k = float(r.k)
    mem = r.mem.astype(np.float64)
    s1 = 2 * (np.sqrt(k * k + mem) - k)
    s2 = (mem + float(lo) * lo) / (lo + k)
    return np.where(s1 <= 2 * lo, s1, np.where(s2 <= lo + hi, s2, np.inf))


class Relaxation:
    """Per device, an upper bound on the output area it can cover within T: integer blocks (one, or several
    when that pays), each within the device's memory and the lo x hi output, but no tiling between them."""

    def __init__(self, r: Rates, lo: int, hi: int) -> None:
        self.r, self.lo, self.hi = r, lo, hi
        sig_x = _mem_sigma(r, lo, hi)
        # integer r + c on either side of where memory starts to bind (no use going past lo + hi)
        self.sig_a = np.minimum(np.floor(sig_x), lo + hi)
        self.sig_b = np.minimum(self.sig_a + 1, lo + hi)
        self.usable = r.mem >= 2 * r.k + 1  # a 1x1 block fits
        self.tile_max = self.single(np.full(len(r.lat), np.inf))  # the largest block memory allows
        self.tile_sigma = np.where(  # ... and its rows + columns
            np.minimum(box_area(self.sig_b, lo, hi), r.mem - self.sig_b * r.k) >= self.tile_max,
            self.sig_b,
            self.sig_a,
        )
        # Several blocks: each covers at most rho·(its rows + columns), rho being the best ratio of area to
        # rows + columns under memory and the box, and at most the unboxed square area (superadditive).
        best = np.minimum(sig_x, lo + hi)
        self.rho = np.where(best <= 2 * lo, best / 4, lo * (best - lo) / np.maximum(best, 1e-300))

    def single(self, tau: np.ndarray) -> np.ndarray:
        """The largest single block each device finishes within tau after its latency."""
        lines = np.floor(tau * self.r.lines + FLOOR_SLACK)
        out = np.zeros(len(self.r.lat))
        for sig in (np.minimum(lines, self.sig_a), np.minimum(lines, self.sig_b)):
            out = np.maximum(out, np.minimum(box_area(sig, self.lo, self.hi), self.r.mem - sig * self.r.k))
        return np.minimum(out, np.floor(tau * self.r.area + FLOOR_SLACK))

    def _multi(self, T: float) -> np.ndarray:
        """j >= 2 blocks take j latencies and j·tile_max bounds their area; for each rate c (area/s), the
        best j of min(j·tile_max, c·(T - j·latency)) is where the two meet, or j = 2."""
        r, A = self.r, np.maximum(self.tile_max, 1e-300)
        out = np.full(len(r.lat), np.inf)
        for c in (self.rho * r.lines, r.area):
            j = np.maximum(c * T / (A + c * r.lat), 2)
            out = np.minimum(out, np.minimum(j * A, c * (T - j * r.lat)))
        lines2 = np.maximum(T - 2 * r.lat, 0) * r.lines
        return np.clip(
            np.minimum(out, box_area(np.floor(lines2 + FLOOR_SLACK), self.lo, self.hi, False)), 0, None
        )

    def area(self, T: float) -> np.ndarray:
        tau = np.maximum(T - self.r.lat, 0)
        single = self.single(tau)
        if np.any(self.sig_a < tau * self.r.lines):  # several blocks can only pay where memory binds
            single = np.maximum(single, self._multi(T))
        return np.where(self.usable, np.minimum(single, float(self.lo) * self.hi), 0.0)


def relaxed_area(r: Rates, T: float, lo: int, hi: int) -> np.ndarray:
    """`Relaxation(r, lo, hi).area(T)`: the relaxation's per-device capacity at T."""
    return Relaxation(r, lo, hi).area(T)


def device_bound(r: Rates, m: int, n: int) -> float:
    """Smallest T (to BOUND_RTOL, rounded down) at which the relaxed capacities reach m·n."""
    relax = Relaxation(r, min(m, n), max(m, n))
    need = float(m) * n
    if not relax.usable.any():
        raise PlanError("no device has memory for even a 1x1 tile")

    def enough(T: float) -> bool:
        return float(relax.area(T).sum()) >= need

    lo = float(r.lat.min())
    step = max(lo, 1e-6)
    hi = lo + step
    while not enough(hi):
        lo, step = hi, step * 2
        hi = lo + step
    while hi - lo > BOUND_RTOL * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return lo


def gemm_bound(fleet: Fleet, r: Rates, m: int, n: int, b: int, ps_bandwidth: float | None) -> GemmBound:
    """All three lower bounds on the makespan of C[m, n] = A[m, k] · B[k, n] on this fleet."""
    flops_s = 2.0 * m * n * r.k / float(fleet.flops.sum())
    egress_s = egress_bytes(m, n, r.k, b) / ps_bandwidth if ps_bandwidth else 0.0
    return GemmBound(device_bound(r, m, n), flops_s, egress_s)
