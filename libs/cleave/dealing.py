"""What a plan's blocks take at run time, as the PS deals them (pure).

The planner sizes blocks by the overlapped cost model (latency + max(down, compute, up) per device). At
run time the PS cuts each block into pieces (`cut`), keeps up to max(window, chunks) of a device's pieces in
flight, sends an input block to a device once (it caches it), fans shared blocks out to their group, and
copies a piece that runs far too long to an idle device; the devices stream the pieces through their
downlink, compute and uplink (`profile.streamed`). `dealt_makespan` predicts that with the PS's own dealing
core (`cleave.dealer.Dealer`) on devices that keep their profiles, as the simulator's engine plays them
(`cleave.sim.engine`): the scheduler publishes it as the plan's `makespan_s` and `predicted_step_s`, and the
simulator's undisturbed GEMMs take exactly it. Past PREDICT_BUDGET it falls back to `streamed_makespan`,
each device alone with its own pieces (no copies, no fan-out), which is exact only where no piece is copied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from cleave import tiles
from cleave.ledger import DEFAULT_WINDOW
from cleave.profile import dealt_time
from cleave.schemas import DeviceProfile

Box = tuple[int, int, int, int]  # rows r0:r1, columns c0:c1 of the output
UNLIMITED = 1 << 62
PREDICT_RUNS = 3  # a GEMM kind is dealt this often in a row and the last counts: the dealer's round trips and
# its suspicion of a device that copies keep beating settle by then (the even split of benchmarks/real_links.py:
# 15.3, 11.3, 10.1, then 10.0-10.4 s a step)
# pieces x devices above which a GEMM is predicted by `streamed_makespan`: the dealer costs ~1.5 us per piece
# and device, so 100,000 is ~0.5 s for one GEMM kind (its three runs); 100 devices x 1,000 pieces fit
PREDICT_BUDGET = 20_000


def cut(box: Box, k: int, b: int, tile_rows: int, tile_cols: int, chunks: int, cache_bytes: int) -> list[Box]:
    """A planned block as the PS sends it (`tiles.cut_block`), streamed in `chunks` pieces only where its
    shared input (the rows of the shorter side, sent with the first piece) stays in the device's block
    cache next to a piece; else whole tiles, since re-sending it with every piece costs more than
    streaming saves (edge devices with k = 131,072 weight-gradient GEMMs)."""
    r0, r1, c0, c1 = box
    short, long = sorted((min(r1 - r0, tile_rows), min(c1 - c0, tile_cols)))
    if (short + -(-long // max(chunks, 1))) * k * b > cache_bytes:
        chunks = 1
    return tiles.cut_block(box, tile_rows, tile_cols, chunks)


def pieces(blocks: Sequence[Box], k: int, b: int, tile_rows: int, tile_cols: int,
           chunks: int, cache_bytes: int = UNLIMITED) -> list[tuple[float, float, float]]:
    """(bytes down, bytes up, FLOPs) of each piece one device is sent for its `blocks`, in dealing order;
    an input block already sent to the device is not sent again."""
    seen: set[tuple[str, int, int]] = set()
    out = []
    for box in blocks:
        for r0, r1, c0, c1 in cut(box, k, b, tile_rows, tile_cols, chunks, cache_bytes):
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


def dealt_makespan(boxes: Sequence[Box], owners: Sequence[str], profiles: Mapping[str, DeviceProfile], k: int,
                   b: int, tile_rows: int, tile_cols: int, chunks: int, window: int = DEFAULT_WINDOW,
                   cache_bytes: Mapping[str, int] | None = None, fan_out: bool = True,
                   budget: int = PREDICT_BUDGET) -> float:
    """Seconds of one GEMM of these blocks (planned for `owners`) on the devices `profiles` (every member
    of the plan: idle ones take copies), dealt by the PS's dealing core with its default policy and
    `window`, once its round trips for the shape are known and its suspicions settled: the GEMM is dealt
    PREDICT_RUNS times in a row and the last counts. See the module docstring for the budget."""
    from cleave.sim.engine import TileSet, play  # here: cleave.sim imports this module

    caches = cache_bytes or {}
    cut_boxes: list[Box] = []
    cut_owners: list[str] = []
    for box, owner in zip(boxes, owners, strict=True):
        parts = cut(box, k, b, tile_rows, tile_cols, chunks, caches.get(owner, UNLIMITED))
        cut_boxes += parts
        cut_owners += [owner] * len(parts)
    if not cut_boxes:
        return 0.0
    if len(cut_boxes) * len(profiles) > budget:
        return streamed_makespan(boxes, owners, profiles, k, b, tile_rows, tile_cols, chunks, window, caches)
    m, n = int(np.max([x[1] for x in cut_boxes])), int(np.max([x[3] for x in cut_boxes]))
    ts = TileSet(m, n, k, b, tiles.from_boxes(cut_boxes), cut_owners, 0.0, chunks)
    return play(ts, profiles, {w: caches.get(w, UNLIMITED) for w in profiles}, window, fan_out, PREDICT_RUNS)[-1]
