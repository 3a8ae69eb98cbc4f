"""Strip packing of one GEMM's output onto devices, and the search for the smallest makespan it reaches.

Work happens in an oriented frame: the output is S x L, cut into bands of whole rows of the frame (a band
is `h` x L); every device in a band gets all `h` rows and its own run of columns. A row band is one shared
strip (published once), and devices in a band have nearly equal shapes when they are similar, so bands
are formed from devices sorted by the side of the largest square tile they finish within the target time.

At a target time T each device (or each of its `j` rounds, when its memory forces several tiles) gets a
budget of T minus its latency. Three ways to group the sorted devices into bands: `pack_dp` (a dynamic
programme over all consecutive groupings, exact for that family; small fleets), `pack_scan` (band after
band, each with exactly the devices its height needs) and `pack_greedy` (vectorised: consecutive devices
whose square sides add up to L, each band at its largest integer height). `search` finds the smallest T
at which a packer covers the S rows; `solve` picks packers and orientations by fleet size.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cleave.errors import PlanError
from cleave.plan.costmodel import Rates, Relaxation, box_area, ideal_side, max_cols, tile_time

DP_MAX_DEVICES = 40  # pack_dp's cost grows as n² x the number of candidate heights
DP_MAX_HEIGHTS = 512  # candidate band heights for pack_dp when S is larger
RTOL_LARGE = 2e-4  # relative precision of the makespan search for large fleets
RTOL_SMALL = 1e-5  # ... with the exact-grouping packer (small fleets)
GREEDY_MIN_SIDE = 48  # large fleets: typical tile side from which the greedy packer beats the scan
MAX_VIRTUAL = 200_000  # tiles per GEMM beyond which memory is simply too small for the job
SCAN_TRY_MAX_DEVICES = 500  # smaller fleets try several heights per band


@dataclass(frozen=True, eq=False)
class Virtual:
    """The tiles-to-be at a target T: device `dev[v]` has `tau[v]` seconds after its latency for tile v."""

    dev: np.ndarray
    tau: np.ndarray
    rates: Rates  # rates of dev[v], one row per virtual device


@dataclass(frozen=True, eq=False)
class Layout:
    """Blocks in the oriented frame: virtual device `vdev[i]` gets rows s0:s1 and columns l0:l1."""

    vdev: np.ndarray
    s0: np.ndarray
    s1: np.ndarray
    l0: np.ndarray
    l1: np.ndarray


def _rounds(relax: Relaxation, T: float) -> np.ndarray:
    """Tiles per device at T: 1, or as many of the largest tiles its memory holds as fit in T, where memory
    caps a tile below what the time would allow."""
    r = relax.r
    tau = np.maximum(T - r.lat, 0)
    by_time = np.minimum(tau * r.area, box_area(np.floor(tau * r.lines), relax.lo, relax.hi))
    per_tile = r.lat + np.maximum(relax.tile_sigma / r.lines, relax.tile_max / r.area)
    binds = (relax.tile_max >= 1) & (relax.tile_max < by_time)
    fit = np.floor(T / np.maximum(per_tile, 1e-12))  # tiles of the largest size that fit in T
    j = np.where(binds, np.clip(fit, 1, MAX_VIRTUAL + 1), 1).astype(np.int64)
    if binds.any():  # floor(T / per_tile) full tiles, or one or two more, smaller ones: whichever covers most
        cands = [j + d for d in (0, 1, 2)]
        covers = np.stack([c * relax.single(np.maximum(T / c - r.lat, 0)) for c in cands])
        j = np.where(binds, np.choose(np.argmax(covers, axis=0), cands), 1)
    area = np.where(j > 1, j * relax.tile_max, 0.0)
    need = float(relax.lo) * relax.hi
    if area.sum() > 2.0 * need:  # more rounds than covering the output needs only inflate the problem
        j = np.where(j > 1, np.maximum(1, np.ceil(j * (2.0 * need / area.sum()))), 1).astype(np.int64)
    return j


def virtual_devices(relax: Relaxation, T: float) -> Virtual:
    """Expand devices into their tiles' budgets at target time T."""
    r = relax.r
    j = _rounds(relax, T)
    if int(j.sum()) > max(MAX_VIRTUAL, len(j)):  # (one tile a device is never too many: a fleet may be larger)
        raise PlanError(
            f"device memory is too small for this {relax.lo}x{relax.hi} output (k={r.k}): the "
            f"largest tile any device holds has {int(relax.tile_max.max())} elements, and the plan "
            f"would need more than {MAX_VIRTUAL} tiles; give the devices more memory or use a "
            "smaller batch"
        )
    dev = np.repeat(np.arange(len(j)), j)
    tau = T / j[dev] - r.lat[dev]
    return Virtual(dev, tau, r.take(dev))


def _sorted_usable(v: Virtual, S: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    """Virtual devices that can finish a 1x1 tile, strongest first, with their square sides."""
    side = ideal_side(v.rates, v.tau, min(S, L))
    ok = np.flatnonzero((side >= 1) & (max_cols(v.rates, v.tau, 1, L) >= 1))
    order = ok[np.argsort(-side[ok], kind="stable")]
    return order, side[order]


def _band_heights(v: Virtual, order: np.ndarray, band: np.ndarray, S: int, L: int) -> np.ndarray:
    """Per band, the largest integer height (0 if none) at which its devices' widths reach L."""
    nb = int(band[-1]) + 1
    rs, tau = v.rates.take(order), v.tau[order]
    lo = np.zeros(nb, dtype=np.int64)
    hi = np.full(nb, S + 1, dtype=np.int64)
    while True:
        active = hi - lo > 1
        if not active.any():
            return lo
        mid = np.where(active, (lo + hi) // 2, np.maximum(lo, 1))
        widths = np.bincount(band, weights=max_cols(rs, tau, mid[band], L), minlength=nb)
        ok = widths >= L
        lo = np.where(active & ok, mid, lo)
        hi = np.where(active & ~ok, mid, hi)


def pack_greedy(v: Virtual, S: int, L: int) -> tuple[int, Callable[[], Layout]]:
    """Bands of consecutive sorted devices whose square sides add up to about L; returns (rows covered,
    a function building the layout)."""
    order, side = _sorted_usable(v, S, L)
    if len(order) == 0:
        return 0, lambda: _empty()
    band = ((np.cumsum(side) - side / 2) // L).astype(np.int64)
    heights = _band_heights(v, order, band, S, L)
    covered = int(heights.sum())
    return covered, lambda: _build(v, order, band, heights, S, L)


def _scan_band(rs: Rates, tau: np.ndarray, p: int, end: int, h: int, L: int) -> int:
    """Index one past the last device of a band of height h starting at p (window p:end), or -1."""
    w = max_cols(rs.take(slice(p, end)), tau[p:end], h, L)
    q = int(np.searchsorted(np.cumsum(w), L))
    return p + q + 1 if q < len(w) else -1


def _scan_heights(side: np.ndarray, p: int, q0: int, rows_left: int, tries: int) -> list[int]:
    """Candidate heights of the band starting at p whose square sides reach L at q0: the side of its
    middle device (evening out the last bands), the side of its first device where that is much larger,
    and with `tries` > 1 their neighbours and the whole remaining height."""
    h0 = max(1, int(side[min((p + q0) // 2, len(side) - 1)]))
    if rows_left < 3 * h0:  # even out the last bands rather than end on a thin one
        h0 = -(-rows_left // max(1, round(rows_left / h0)))
    first = max(1, int(side[p]))
    cands = {h0, first} if first > 1.5 * h0 else {h0}
    if tries > 1:
        cands |= {c + d for c in tuple(cands) for d in range(-(tries // 2), tries - tries // 2)} | {rows_left}
    return sorted({min(max(c, 1), rows_left) for c in cands})


def _scan_next(
    rs: Rates, tau: np.ndarray, sq: list[float], p: int, q0: int, hs: list[int], L: int
) -> tuple[int, int]:
    """(height, next start) of the band at p: of the candidate heights, the one covering the most rows per
    unit of square area its devices could have covered; (0, -1) if no height closes the band."""
    n, best = len(tau), (-1.0, 0, -1)
    for h in hs:
        nxt = _scan_band(rs, tau, p, min(n, p + 2 * (q0 - p + 1) + 8), h, L)
        if nxt < 0:
            nxt = _scan_band(rs, tau, p, n, h, L)
        if nxt > 0:
            best = max(best, (h / max(sq[nxt - 1] - (sq[p - 1] if p else 0.0), 1e-300), h, nxt))
    while best[2] < 0 and hs[0] > 1:  # weak devices left: try thinner bands
        hs = [hs[0] // 2]
        nxt = _scan_band(rs, tau, p, n, hs[0], L)
        best = (0.0, hs[0], nxt)
    return best[1], best[2]


def pack_scan(v: Virtual, S: int, L: int) -> tuple[int, Callable[[], Layout]]:
    """Bands one after another over the sorted devices: each takes about the integer square side of its
    middle device as its height, and exactly as many devices as its widths need to reach L."""
    order, side = _sorted_usable(v, S, L)
    n = len(order)
    rs, tau = v.rates.take(order), v.tau[order]
    cs, sq = np.cumsum(side).tolist(), np.cumsum(side * side).tolist()
    tries = 1 if n > SCAN_TRY_MAX_DEVICES else 5
    starts, heights = [], []
    p, covered = 0, 0
    while covered < S and p < n:
        q0 = bisect_left(cs, (cs[p - 1] if p else 0.0) + L, lo=p)
        h, nxt = _scan_next(rs, tau, sq, p, q0, _scan_heights(side, p, q0, S - covered, tries), L)
        if nxt < 0:
            break
        starts.append(p)
        heights.append(h)
        covered += h
        p = nxt
    if not starts:
        return 0, lambda: _empty()
    band = np.repeat(np.arange(len(starts)), np.diff([*starts, p]))
    return covered, lambda: _build(v, order[:p], band, np.array(heights, dtype=np.int64), S, L)


def _dp_heights(v: Virtual, order: np.ndarray, S: int, L: int) -> np.ndarray:
    """best[i, j]: the largest height a band of sorted devices i..j-1 can take (0 if none)."""
    hs = (
        np.arange(1, S + 1)
        if S <= DP_MAX_HEIGHTS
        else np.unique(np.concatenate([np.geomspace(1, S, DP_MAX_HEIGHTS).astype(np.int64), [S]]))
    )
    rs = v.rates.take(order)
    col = Rates(rs.lat[:, None], rs.lines[:, None], rs.area[:, None], rs.mem[:, None], rs.k)
    widths = max_cols(col, v.tau[order][:, None], hs[None, :], L)
    cum = np.vstack([np.zeros((1, len(hs)), np.int64), np.cumsum(widths, axis=0)])
    fits = (cum[None, :, :] - cum[:, None, :]) >= L  # (i, j, h), non-increasing in h
    count = fits.sum(axis=2)
    return np.where(count > 0, hs[np.maximum(count - 1, 0)], 0)


def pack_dp(v: Virtual, S: int, L: int) -> tuple[int, Callable[[], Layout]]:
    """The best grouping of sorted devices into consecutive bands (devices may be skipped)."""
    order, _ = _sorted_usable(v, S, L)
    n = len(order)
    if n == 0:
        return 0, lambda: _empty()
    best = _dp_heights(v, order, S, L)
    total = np.zeros(n + 1, dtype=np.int64)
    start = np.full(n + 1, -1, dtype=np.int64)  # band i..j-1 ends at j, or -1: device j-1 skipped
    for j in range(1, n + 1):
        cand = total[:j] + best[:j, j]
        i = int(np.argmax(cand))
        if cand[i] > total[j - 1] and best[i, j] > 0:
            total[j], start[j] = cand[i], i
        else:
            total[j] = total[j - 1]
    chosen, j = [], n
    while j > 0:
        if start[j] < 0:
            j -= 1
            continue
        chosen.append((int(start[j]), j))
        j = int(start[j])
    chosen.reverse()
    band = np.concatenate([np.full(j - i, g) for g, (i, j) in enumerate(chosen)]) if chosen else np.zeros(0)
    members = np.concatenate([order[i:j] for i, j in chosen]) if chosen else order[:0]
    heights = np.array([best[i, j] for i, j in chosen], dtype=np.int64)
    return int(total[n]), lambda: _build(v, members, band.astype(np.int64), heights, S, L)


def _empty() -> Layout:
    z = np.zeros(0, dtype=np.int64)
    return Layout(z, z, z, z, z)


def _fit_widths(band: np.ndarray, width: np.ndarray, L: int) -> np.ndarray:
    """Scale each band's widths down so they add up to exactly L (largest remainders get the spare)."""
    nb = int(band.max()) + 1
    total = np.bincount(band, weights=width, minlength=nb)
    x = width * (L / total[band])
    base = np.floor(x).astype(np.int64)
    spare = L - np.bincount(band, weights=base, minlength=nb).round().astype(np.int64)
    order = np.lexsort((-(x - base), band))
    first = np.searchsorted(band[order], np.arange(nb))
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order)) - first[band[order]]
    return np.minimum(base + (rank < spare[band]), width)


def _build(v: Virtual, members: np.ndarray, band: np.ndarray, heights: np.ndarray, S: int, L: int) -> Layout:
    """Blocks of the bands that cover S first (the last one trimmed); devices of the others stay idle."""
    reach = np.cumsum(heights)
    last = int(np.searchsorted(reach, S))  # the first band whose cumulative height reaches S
    keep = band <= last
    members, band = members[keep], band[keep]
    heights = heights[: last + 1].copy()
    heights[-1] -= int(reach[last]) - S
    live = heights[band] > 0
    members, band = members[live], band[live]
    rs = v.rates.take(members)
    width = max_cols(rs, v.tau[members], np.maximum(heights[band], 1), L)
    width = _fit_widths(band, width, L)
    used = width > 0
    members, band, width = members[used], band[used], width[used]
    l1 = np.cumsum(width)
    l1 -= np.concatenate([[0], np.cumsum(np.bincount(band, weights=width))[:-1]]).astype(np.int64)[band]
    top = np.concatenate([[0], np.cumsum(heights)])
    return Layout(members, top[band], top[band + 1], l1 - width, l1)


def device_times(r: Rates, v: Virtual, lay: Layout) -> np.ndarray:
    """Seconds each physical device spends on its tiles of this layout (0 for idle devices)."""
    dev = v.dev[lay.vdev]
    t = tile_time(r, dev, lay.s1 - lay.s0, lay.l1 - lay.l0)
    return np.bincount(dev, weights=t, minlength=len(r.lat))


Packer = Callable[[Virtual, int, int], tuple[int, Callable[[], Layout]]]


def search(r: Rates, S: int, L: int, t_low: float, packer: Packer, rtol: float) -> tuple[Virtual, Layout]:
    """The smallest target T (to rtol) at which `packer` covers all S rows, and its layout."""

    relax = Relaxation(r, min(S, L), max(S, L))

    def attempt(T: float) -> tuple[Virtual, Callable[[], Layout]] | None:
        v = virtual_devices(relax, T)
        covered, build = packer(v, S, L)
        return (v, build) if covered >= S else None

    found = attempt(t_low)
    lo, hi, step = t_low, t_low, 2 * rtol
    while found is None:
        if step > 1e6:
            raise PlanError("no target time up to 1e6 x the lower bound gives a plan")
        lo, hi = hi, t_low * (1 + step)
        found, step = attempt(hi), step * 2
    best = found
    while hi - lo > rtol * hi:
        mid = 0.5 * (lo + hi)
        got = attempt(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    v, build = best
    return v, build()


@dataclass(frozen=True, eq=False)
class Blocks:
    """Blocks in canonical axes: `a` has the GEMM's shorter side, `b` its longer one."""

    dev: np.ndarray
    a0: np.ndarray
    a1: np.ndarray
    b0: np.ndarray
    b1: np.ndarray
    time_s: np.ndarray  # per block
    device_time_s: float  # the busiest device's total


def _oriented(r: Rates, v: Virtual, lay: Layout, swap: bool) -> Blocks:
    dev = v.dev[lay.vdev]
    t = tile_time(r, dev, lay.s1 - lay.s0, lay.l1 - lay.l0)
    busiest = float(device_times(r, v, lay).max())
    if swap:  # the frame's S axis is the longer side
        return Blocks(dev, lay.l0, lay.l1, lay.s0, lay.s1, t, busiest)
    return Blocks(dev, lay.s0, lay.s1, lay.l0, lay.l1, t, busiest)


def _dp_or(packer: Packer) -> Packer:
    def pick(v: Virtual, S: int, L: int) -> tuple[int, Any]:
        return pack_dp(v, S, L) if len(v.dev) <= DP_MAX_DEVICES else packer(v, S, L)

    return pick


def solve(r: Rates, lo: int, hi: int, t_low: float) -> Blocks:
    """Pack the lo x hi output. Small fleets group devices exactly (pack_dp) in both orientations; mid-size
    ones keep the better of a scan along the long side and a greedy packing across it; large ones pick one:
    many similar-device bands across the long side (greedy) unless tiles are small, where the greedy's
    integer heights waste more than a scan of fewer, mixed bands along it."""
    n = len(r.lat)
    scan_long = (_dp_or(pack_scan), lo, hi, False)
    greedy_across = (_dp_or(pack_greedy), hi, lo, True)
    if n <= DP_MAX_DEVICES:
        tries = [scan_long, (_dp_or(pack_scan), hi, lo, True)]
    elif n <= SCAN_TRY_MAX_DEVICES:
        tries = [scan_long, greedy_across]
    else:
        active = int(np.count_nonzero(Relaxation(r, lo, hi).area(t_low)))
        side = np.sqrt(float(lo) * hi / max(active, 1))
        tries = [greedy_across if side >= GREEDY_MIN_SIDE else scan_long]
    best: Blocks | None = None
    failed: PlanError | None = None
    for packer, S, L, swap in tries:
        try:  # an orientation may find no plan (memory) where the other does
            v, lay = search(r, S, L, t_low, packer, RTOL_SMALL if n <= DP_MAX_DEVICES else RTOL_LARGE)
        except PlanError as e:
            failed = e
            continue
        got = _oriented(r, v, lay, swap)
        if best is None or got.device_time_s < best.device_time_s:
            best = got
    if best is None:
        assert failed is not None
        raise failed
    return best
