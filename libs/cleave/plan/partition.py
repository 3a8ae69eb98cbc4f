"""The fleet split among a job's PS replicas (pure: no I/O).

With `--ps-replicas R` each replica deals its share of every global batch to its own part of the fleet.
The scheduler scores every device by the cost model (`device_rate`: the job's GEMMs per second it would
manage alone, tile by tile: latency + max(downlink, uplink, compute)), splits the fleet so that the
replicas' summed rates are as even as it can (`partition`, largest first onto the lightest replica) and
keeps the split sticky across churn: survivors stay where they are, a joiner goes to the lightest replica,
and the whole fleet is dealt again only when a replica ends up empty or far lighter than another.
`restrict` turns the fleet's plan into each replica's plan (its workers only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from cleave.plan.profile import tile_seconds
from cleave.schemas import DeviceProfile, GemmSpec, Plan

DEFAULT_IMBALANCE = 1.5  # a sticky split is redone once its heaviest replica has this many times the lightest's rate


def device_rate(p: DeviceProfile, gemms: Iterable[GemmSpec], b: int, tile_rows: int, tile_cols: int) -> float:
    """Steps of these GEMMs a second that device `p` would manage on its own, in tiles of at most
    tile_rows x tile_cols (without GEMMs: its FLOP/s, so that devices still compare)."""
    seconds = 0.0
    for g in gemms:
        rows, cols = min(g.m, tile_rows), min(g.n, tile_cols)
        tiles = -(-g.m // rows) * -(-g.n // cols)
        seconds += g.count_per_step * tiles * tile_seconds(p, rows, cols, g.k, b)
    return 1.0 / seconds if seconds > 0 else p.flops


def _deal(rates: Mapping[str, float], replicas: int, start: dict[str, int]) -> dict[str, int]:
    """`start` plus every other device, fastest first, onto the replica with the least rate so far."""
    load = [0.0] * replicas
    for w, r in start.items():
        load[r] += rates[w]
    out = dict(start)
    for w in sorted((w for w in rates if w not in start), key=lambda w: (-rates[w], w)):
        r = min(range(replicas), key=lambda i: (load[i], i))
        out[w] = r
        load[r] += rates[w]
    return out


def balanced(rates: Mapping[str, float], assignment: Mapping[str, int], replicas: int,
             imbalance: float = DEFAULT_IMBALANCE) -> bool:
    """No replica is empty (while some other has two or more devices) and the heaviest's summed rate is at
    most `imbalance` times the lightest's."""
    load, count = [0.0] * replicas, [0] * replicas
    for w, r in assignment.items():
        load[r] += rates[w]
        count[r] += 1
    if min(count) == 0:
        return max(count) <= 1
    return max(load) <= imbalance * min(load)


def partition(rates: Mapping[str, float], replicas: int, previous: Mapping[str, int] | None = None,
              imbalance: float = DEFAULT_IMBALANCE) -> dict[str, int]:
    """Device id -> replica (0..replicas-1). Devices of `previous` that are still here keep their replica
    while the result stays `balanced`; otherwise the whole fleet is dealt afresh."""
    if replicas < 1:
        raise ValueError(f"replicas={replicas} must be at least 1")
    kept = {w: r for w, r in (previous or {}).items() if w in rates and 0 <= r < replicas}
    sticky = _deal(rates, replicas, kept)
    if not kept or balanced(rates, sticky, replicas, imbalance):
        return sticky
    return _deal(rates, replicas, {})


def restrict(plan: Plan, assignment: Mapping[str, int], replicas: int) -> list[Plan]:
    """Replica r's plan: the fleet's plan with only the workers assigned to r and no layouts (each replica's
    plan is cost-planned for its own workers afterwards)."""
    parts: list[list] = [[] for _ in range(replicas)]
    for w in plan.workers:
        parts[assignment[w.worker_id]].append(w)
    fields = {k: getattr(plan, k) for k in ("version", "created_at", "tile_rows", "tile_cols", "chunks", "reason")}
    return [Plan(**fields, workers=tuple(ws)) for ws in parts]


def shares(total: int, replicas: int) -> Sequence[tuple[int, int]]:
    """Rows [lo, hi) of a global batch of `total` sequences that each replica trains on (equal shares)."""
    if replicas < 1 or total % replicas:
        raise ValueError(f"a batch of {total} cannot be split evenly among {replicas} PS replicas")
    n = total // replicas
    return [(r * n, (r + 1) * n) for r in range(replicas)]
