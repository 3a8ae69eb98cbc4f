"""What a plan's blocks take at run time, as the PS deals them (pure).

The planner sizes blocks by the overlapped cost model (latency + max(down, compute, up) per device). At
run time the PS cuts each block into pieces (`cut`), keeps up to max(window, chunks) of a
device's pieces in flight, sends an input block to a device once (it caches it), and the device streams
the pieces through its downlink, compute and uplink (`profile.dealt_time`). The scheduler publishes these
times as the plan's `makespan_s` and `predicted_step_s`; the simulator's undisturbed GEMMs take exactly them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cleave import tiles
from cleave.ledger import DEFAULT_WINDOW
from cleave.profile import dealt_time
from cleave.schemas import DeviceProfile

Box = tuple[int, int, int, int]  # rows r0:r1, columns c0:c1 of the output
UNLIMITED = 1 << 62


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


def dealt_makespan(boxes: Sequence[Box], owners: Sequence[str], profiles: Mapping[str, DeviceProfile], k: int,
                   b: int, tile_rows: int, tile_cols: int, chunks: int, window: int = DEFAULT_WINDOW,
                   cache_bytes: Mapping[str, int] | None = None) -> float:
    """Seconds until the busiest device has returned every piece of its blocks of one GEMM."""
    mine: dict[str, list[Box]] = {}
    for box, owner in zip(boxes, owners, strict=True):
        mine.setdefault(owner, []).append(box)
    caches = cache_bytes or {}
    return max((dealt_time(profiles[o], pieces(blocks, k, b, tile_rows, tile_cols, chunks,
                                               caches.get(o, UNLIMITED)), max(window, chunks))
                for o, blocks in mine.items()), default=0.0)
