"""GEMM tiling: cut C[m, n] = A[m, k] · Bᵀ[n, k]ᵀ into output blocks and put the blocks back.

Each tile owns rows r0:r1 and columns c0:c1 of the output; its inputs are the row block A[r0:r1, :] and the
row block Bᵀ[c0:c1, :]. The inner dimension k is never split, so a block is final when it comes back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # (the scheduler plans tiles without torch)
    import torch


@dataclass(frozen=True, slots=True)
class Tile:
    index: int
    r0: int
    r1: int
    c0: int
    c1: int

    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    @property
    def cols(self) -> int:
        return self.c1 - self.c0


def cuts(size: int, block: int) -> list[tuple[int, int]]:
    """Half-open ranges of at most `block` covering [0, size); the last may be ragged."""
    if size <= 0 or block <= 0:
        raise ValueError(f"size {size} and block {block} must be positive")
    return [(s, min(s + block, size)) for s in range(0, size, block)]


MIN_BLOCK = 16  # blocks are not cut thinner than this to feed more workers
DEFAULT_TILE = 1024  # the largest block sent as one tile (the scheduler's tile_rows and tile_cols)
DEFAULT_CHUNKS = 4  # a planned block goes out in at least this many pieces (the scheduler's chunks)
UNPLANNED_TILE = 256  # a GEMM dealt before any plan arrived: tiles of at most this side
Box = tuple[int, int, int, int]  # rows r0:r1, columns c0:c1 of the output


def fit_block(m: int, n: int, rows: int, cols: int, workers: int) -> tuple[int, int]:
    """A rows x cols block for an m x n output, halved (larger side first) until every worker can get one."""
    rows, cols = min(rows, m), min(cols, n)
    while -(-m // rows) * -(-n // cols) < workers:
        if rows >= cols and rows >= 2 * MIN_BLOCK:
            rows = -(-rows // 2)
        elif cols >= 2 * MIN_BLOCK:
            cols = -(-cols // 2)
        else:
            break
    return rows, cols


def uniform_block(m: int, n: int, tile: tuple[int, int] | None, workers: int) -> tuple[int, int]:
    """The tile of a GEMM dealt as a uniform grid (no planned layout for its shape): the plan's largest tile
    (`None`: no plan yet, UNPLANNED_TILE), halved until every worker can get one."""
    rows, cols = tile or (UNPLANNED_TILE, UNPLANNED_TILE)
    return fit_block(m, n, rows, cols, workers)


def grid(m: int, n: int, block_rows: int, block_cols: int) -> list[Tile]:
    """Row-major grid of tiles covering the m x n output exactly (ragged last row and column)."""
    return [
        Tile(i, r0, r1, c0, c1)
        for i, ((r0, r1), (c0, c1)) in enumerate(
            (r, c) for r in cuts(m, block_rows) for c in cuts(n, block_cols)
        )
    ]


def subdivide(boxes: list[tuple[int, int, int, int]], max_rows: int, max_cols: int) -> list[tuple[int, int, int, int]]:
    """Cut each (r0, r1, c0, c1) box into blocks of at most max_rows x max_cols (same cover)."""
    out = []
    for r0, r1, c0, c1 in boxes:
        for a, b in cuts(r1 - r0, max_rows):
            for c, d in cuts(c1 - c0, max_cols):
                out.append((r0 + a, r0 + b, c0 + c, c0 + d))
    return out


def cut_block(box: tuple[int, int, int, int], max_rows: int, max_cols: int, chunks: int = 1) -> list[tuple[int, int, int, int]]:
    """A planned block as the PS sends it: pieces of at most max_rows x max_cols, and at least `chunks`
    pieces where the block is large enough (cut along its longer side, whose input is the larger, into equal
    parts no thinner than MIN_BLOCK), so that a device computes one piece while the next arrives and the
    last leaves. Same cover as the block."""
    parts = subdivide([box], max_rows, max_cols)
    if len(parts) >= chunks:
        return parts
    out = []
    per = -(-chunks // len(parts))
    for r0, r1, c0, c1 in parts:
        along_rows = r1 - r0 >= c1 - c0
        lo, hi = (r0, r1) if along_rows else (c0, c1)
        pieces = max(1, min(per, (hi - lo) // MIN_BLOCK))
        edges = [lo + (hi - lo) * i // pieces for i in range(pieces + 1)]
        for a, b in zip(edges, edges[1:], strict=False):
            out.append((a, b, c0, c1) if along_rows else (r0, r1, a, b))
    return out


def cut_planned(box: Box, k: int, b: int, tile_rows: int, tile_cols: int, chunks: int, cache_bytes: int) -> list[Box]:
    """A planned block as the PS sends it (`tiles.cut_block`), streamed in `chunks` pieces only where its
    shared input (the rows of the shorter side, sent with the first piece) stays in the device's block
    cache next to a piece; else whole tiles, since re-sending it with every piece costs more than
    streaming saves (edge devices with k = 131,072 weight-gradient GEMMs)."""
    r0, r1, c0, c1 = box
    short, long = sorted((min(r1 - r0, tile_rows), min(c1 - c0, tile_cols)))
    if (short + -(-long // max(chunks, 1))) * k * b > cache_bytes:
        chunks = 1
    return cut_block(box, tile_rows, tile_cols, chunks)


def from_boxes(boxes: list[tuple[int, int, int, int]]) -> list[Tile]:
    """Tiles from explicit (r0, r1, c0, c1) boxes, e.g. a planner's assignments."""
    return [Tile(i, *box) for i, box in enumerate(boxes)]


def check_cover(tiles: list[Tile], m: int, n: int) -> None:
    """Raise ValueError unless the tiles cover [0, m) x [0, n) exactly once."""
    covered = np.zeros((m, n), dtype=np.int32)
    for t in tiles:
        if not (0 <= t.r0 < t.r1 <= m and 0 <= t.c0 < t.c1 <= n):
            raise ValueError(f"tile {t} outside the {m}x{n} output")
        covered[t.r0 : t.r1, t.c0 : t.c1] += 1
    if not (covered == 1).all():
        raise ValueError("tiles leave a gap or overlap")


def compute(a_block: torch.Tensor, bt_block: torch.Tensor) -> torch.Tensor:
    """What a worker does for one tile: a[r, k] · bt[c, k]ᵀ -> [r, c]."""
    return a_block @ bt_block.T


def tiled_matmul(a: torch.Tensor, bt: torch.Tensor, tiles: list[Tile]) -> torch.Tensor:
    """Reference single-process execution of a tiling: must equal a @ bt.T up to float rounding."""
    out = a.new_empty(a.shape[0], bt.shape[0])
    for t in tiles:
        out[t.r0 : t.r1, t.c0 : t.c1] = compute(a[t.r0 : t.r1], bt[t.c0 : t.c1])
    return out
