"""What a plan's blocks take at run time, as the PS deals them (pure).

The planner sizes blocks by the overlapped cost model (latency + max(down, compute, up) per device). At
run time the PS cuts each block into pieces (`cut`), keeps up to max(window, chunks) of a device's pieces in
flight, sends an input block to a device once (it caches it), fans shared blocks out to their group, and
copies a piece that runs far too long to an idle device; the devices stream the pieces through their
downlink, compute and uplink (`profile.streamed`). This module predicts that with the PS's own dealing core
(`cleave.gemm.dealer.Dealer`) on devices that keep their profiles, as the simulator's engine plays them
(`cleave.gemm.engine.play`): `step_makespans` for a step's GEMMs in the order a step runs them, twice, the
second counting (what the scheduler publishes as each layout's `makespan_s` and the plan's
`predicted_step_s`, for a step of one layer: the simulator's undisturbed step takes it within a few
percent); `dealt_makespan` for one GEMM kind alone, dealt three times. A GEMM kind past PREDICT_BUDGET is predicted by `streamed_makespan`, each device alone
with its own pieces (no copies, no fan-out): exact only where no piece is copied and nothing fanned out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from cleave.gemm import tiles
from cleave.gemm.ledger import DEFAULT_WINDOW
from cleave.gemm.tiles import Box
from cleave.plan.profile import dealt_time
from cleave.schemas import DeviceProfile

UNLIMITED = 1 << 62
PREDICT_RUNS = 3  # one GEMM kind alone is dealt this often in a row and the last counts: the dealer's round
# trips and its suspicion of a device that copies keep beating settle by then
PREDICT_STEPS = 2  # a step's GEMMs are dealt in this many steps and the last counts (the first learns round trips)
# pieces x devices above which a GEMM is predicted by `streamed_makespan`: the dealer costs ~1.5 us per piece
# and device, so 100,000 is ~0.5 s for one GEMM kind (its three runs); 100 devices x 1,000 pieces fit
PREDICT_BUDGET = 20_000


def pieces(blocks: Sequence[Box], k: int, b: int, tile_rows: int, tile_cols: int,
           chunks: int, cache_bytes: int = UNLIMITED) -> list[tuple[float, float, float]]:
    """(bytes down, bytes up, FLOPs) of each piece one device is sent for its `blocks`, in dealing order;
    an input block already sent to the device is not sent again."""
    seen: set[tuple[str, int, int]] = set()
    out = []
    for box in blocks:
        for r0, r1, c0, c1 in tiles.cut_planned(box, k, b, tile_rows, tile_cols, chunks, cache_bytes):
            down = 0
            for key, size in ((("a", r0, r1), r1 - r0), (("b", c0, c1), c1 - c0)):
                if key not in seen:
                    seen.add(key)
                    down += size * k * b
            out.append((down, (r1 - r0) * (c1 - c0) * b, 2.0 * (r1 - r0) * (c1 - c0) * k))
    return out


def streamed_makespan(boxes: Sequence[Box], owners: Sequence[str], profiles: Mapping[str, DeviceProfile], k: int,
                      b: int, tile_rows: int, tile_cols: int, chunks: int, window: int = DEFAULT_WINDOW,
                      cache_bytes: Mapping[str, int] | None = None) -> float:
    """Seconds until the busiest device has returned every piece of its own blocks of one GEMM, each device
    alone (`profile.dealt_time`): no piece copied to an idle device, every input sent with its pieces."""
    mine: dict[str, list[Box]] = {}
    for box, owner in zip(boxes, owners, strict=True):
        mine.setdefault(owner, []).append(box)
    caches = cache_bytes or {}
    return max((dealt_time(profiles[o], pieces(blocks, k, b, tile_rows, tile_cols, chunks,
                                               caches.get(o, UNLIMITED)), max(window, chunks))
                for o, blocks in mine.items()), default=0.0)


def tileset(boxes: Sequence[Box], owners: Sequence[str], k: int, b: int, tile_rows: int, tile_cols: int,
            chunks: int, cache_bytes: Mapping[str, int]):  # noqa: ANN201 (a cleave.gemm.engine.TileSet)
    """One GEMM's blocks cut into the pieces the PS sends (`cut`), each owned by its block's device."""
    from cleave.gemm.engine import TileSet  # here: cleave.sim imports this module

    cut_boxes: list[Box] = []
    cut_owners: list[str | None] = []
    for box, owner in zip(boxes, owners, strict=True):
        parts = tiles.cut_planned(box, k, b, tile_rows, tile_cols, chunks, cache_bytes.get(owner, UNLIMITED))
        cut_boxes += parts
        cut_owners += [owner] * len(parts)
    m = max((x[1] for x in cut_boxes), default=0)
    n = max((x[3] for x in cut_boxes), default=0)
    return TileSet(m, n, k, b, tiles.from_boxes(cut_boxes), cut_owners, 0.0, chunks)


def step_makespans(gemms: Sequence[tuple[Sequence[Box], Sequence[str], int]], order: Sequence[int],
                   profiles: Mapping[str, DeviceProfile], b: int, tile_rows: int, tile_cols: int, chunks: int,
                   window: int = DEFAULT_WINDOW, cache_bytes: Mapping[str, int] | None = None,
                   fan_out: bool = True, budget: int = PREDICT_BUDGET) -> list[float]:
    """Seconds of each GEMM kind of a step (`gemms`: its blocks, their owners, its k) on the devices
    `profiles` (every member of the plan: idle ones take copies), dealt by the PS's dealing core in the
    step's order (`order`: kind indices as `cleave.models.step_order` gives them; the scheduler passes
    one layer, each kind once, so that a deep model costs what a shallow one does), in the second of
    PREDICT_STEPS steps; a kind dealt several times a step, its mean. Kinds past `budget` (pieces x
    devices) are left out of the dealing and predicted by `streamed_makespan`."""
    from cleave.gemm.engine import play  # here: cleave.sim imports this module

    caches = {w: (cache_bytes or {}).get(w, UNLIMITED) for w in profiles}
    sets = [tileset(boxes, owners, k, b, tile_rows, tile_cols, chunks, caches) for boxes, owners, k in gemms]
    dealt = [i for i in order if sets[i].tiles and len(sets[i].tiles) * len(profiles) <= budget]
    out = [0.0 if i in dealt else streamed_makespan(boxes, owners, profiles, k, b, tile_rows, tile_cols, chunks,
                                                    window, caches) for i, (boxes, owners, k) in enumerate(gemms)]
    if not dealt:
        return out
    spans: dict[int, list[float]] = {}
    for i, span in zip(dealt, play([sets[i] for i in dealt], dict(profiles), caches, window, fan_out, PREDICT_STEPS),
                       strict=True):
        spans.setdefault(i, []).append(span)
    for i, mine in spans.items():
        out[i] = float(np.mean(mine))
    return out


def dealt_makespan(boxes: Sequence[Box], owners: Sequence[str], profiles: Mapping[str, DeviceProfile], k: int,
                   b: int, tile_rows: int, tile_cols: int, chunks: int, window: int = DEFAULT_WINDOW,
                   cache_bytes: Mapping[str, int] | None = None, fan_out: bool = True,
                   budget: int = PREDICT_BUDGET) -> float:
    """Seconds of one GEMM of these blocks (planned for `owners`) on the devices `profiles`, dealt as in
    `step_makespans` but alone: PREDICT_RUNS times in a row, the last counting (the simulator's guess of a
    GEMM before it simulates it)."""
    from cleave.gemm.engine import play  # here: cleave.sim imports this module

    caches = {w: (cache_bytes or {}).get(w, UNLIMITED) for w in profiles}
    ts = tileset(boxes, owners, k, b, tile_rows, tile_cols, chunks, caches)
    if not ts.tiles:
        return 0.0
    if len(ts.tiles) * len(profiles) > budget:
        return streamed_makespan(boxes, owners, profiles, k, b, tile_rows, tile_cols, chunks, window, caches)
    return play([ts] * PREDICT_RUNS, dict(profiles), caches, window, fan_out)[-1]
