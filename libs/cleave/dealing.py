"""What a plan's blocks take at run time, as the PS deals them (pure).

The planner sizes blocks by the overlapped cost model (latency + max(down, compute, up) per device). At
run time the PS cuts each block into pieces (`tiles.cut_block`), keeps up to max(window, chunks) of a
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


def pieces(blocks: Sequence[Box], k: int, b: int, tile_rows: int, tile_cols: int,
           chunks: int) -> list[tuple[float, float, float]]:
    """(bytes down, bytes up, FLOPs) of each piece one device is sent for its `blocks`, in dealing order;
    an input block already sent to the device is not sent again."""
    seen: set[tuple[str, int, int]] = set()
    out = []
    for box in blocks:
        for r0, r1, c0, c1 in tiles.cut_block(box, tile_rows, tile_cols, chunks):
            down = 0
            for key, size in ((("a", r0, r1), r1 - r0), (("b", c0, c1), c1 - c0)):
                if key not in seen:
                    seen.add(key)
                    down += size * k * b
            out.append((down, (r1 - r0) * (c1 - c0) * b, 2.0 * (r1 - r0) * (c1 - c0) * k))
    return out


def dealt_makespan(boxes: Sequence[Box], owners: Sequence[str], profiles: Mapping[str, DeviceProfile], k: int,
                   b: int, tile_rows: int, tile_cols: int, chunks: int, window: int = DEFAULT_WINDOW) -> float:
    """Seconds until the busiest device has returned every piece of its blocks of one GEMM."""
    mine: dict[str, list[Box]] = {}
    for box, owner in zip(boxes, owners, strict=True):
        mine.setdefault(owner, []).append(box)
    return max((dealt_time(profiles[o], pieces(blocks, k, b, tile_rows, tile_cols, chunks), max(window, chunks))
                for o, blocks in mine.items()), default=0.0)
