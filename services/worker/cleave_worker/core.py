"""The worker's pure core: the bounded input-block cache, the checks on a tile (shapes, dtypes, memory
budget) and the computation of one tile."""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
import torch

from cleave import codec, tiles
from cleave.costmodel import tile_memory_bytes
from cleave.schemas import BlockRef, TileResult, TileTask

HALF = (torch.float16, torch.bfloat16)
FLOAT32_BYTES = 4  # tiles are computed and returned in float32; the PS plans with dtype_bytes=4
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # workers use CUDA when present


class BlockCache:
    """Least-recently-used input blocks, bounded in bytes."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self._blocks: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, block_id: str) -> torch.Tensor | None:
        t = self._blocks.get(block_id)
        if t is not None:
            self._blocks.move_to_end(block_id)
        return t

    def put(self, block_id: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if size > self.capacity or block_id in self._blocks:
            return
        while self.used + size > self.capacity:
            _, old = self._blocks.popitem(last=False)
            self.used -= old.numel() * old.element_size()
        self._blocks[block_id] = t
        self.used += size

    def resolve(self, ref: BlockRef) -> torch.Tensor | None:
        if getattr(ref, "parts", ()):  # a block sent as segments of its rows: their concatenation
            got = [self.resolve(p) for p in ref.parts]
            return None if any(t is None for t in got) else torch.cat(got)
        if ref.tensor is not None:
            t = codec.data_to_tensor(ref.tensor)
            self.put(ref.id, t)
            return t
        t = self.get(ref.id)
        if t is None:
            self.misses += 1
        else:
            self.hits += 1
        return t


def leaves(ref: BlockRef) -> tuple:
    """What a tile's input block arrives as: itself, or its segments (`BlockRef.parts`)."""
    return ref.parts or (ref,)


def tile_bytes(a: torch.Tensor, bt: torch.Tensor) -> int:
    """Memory a tile works in: both input blocks and the output block in float32 (half-precision inputs are
    computed as float32 copies; what arrived counts as cache). The planner's own measure at 4 bytes an
    element, the one every plan keeps within a device's memory: ((rows + cols) * k + rows * cols) * 4."""
    return int(tile_memory_bytes(np.array(a.shape[0]), np.array(bt.shape[0]), a.shape[1], FLOAT32_BYTES))


def check_inputs(a: torch.Tensor, bt: torch.Tensor, budget_bytes: int) -> str:
    """Why these blocks cannot be multiplied within `budget_bytes` of memory, or '' when they can."""
    if a.dim() != 2 or bt.dim() != 2:
        return f"blocks must be 2-D, got {tuple(a.shape)} and {tuple(bt.shape)}"
    if a.shape[1] != bt.shape[1]:
        return f"inner dimensions differ: {a.shape[1]} vs {bt.shape[1]}"
    if a.dtype != bt.dtype or not a.dtype.is_floating_point:
        return f"dtypes {a.dtype} and {bt.dtype} must be one floating type"
    if a.dtype == torch.float64:
        return "float64 blocks are not computed"
    if (need := tile_bytes(a, bt)) > budget_bytes:
        return (f"tile {a.shape[0]}x{bt.shape[0]} (k={a.shape[1]}, {a.dtype}) needs {need} bytes of memory, "
                f"over this worker's budget of {budget_bytes} (CLEAVE_WORKER_MEMORY_BYTES)")
    return ""


def compute(task: TileTask, a: torch.Tensor, bt: torch.Tensor, worker_id: str, corrupt: float = 0.0) -> TileResult:
    """Multiply one tile's blocks (called off the event loop); `corrupt` makes a lying worker for tests."""
    start = time.perf_counter()
    if a.dtype in HALF:  # the approximate mode sends half-precision inputs; products accumulate in float32
        a, bt = a.float(), bt.float()
    out = tiles.compute(a.to(DEVICE), bt.to(DEVICE)).cpu() if DEVICE.type == "cuda" else tiles.compute(a, bt)
    if corrupt:
        out[0, 0] += corrupt
    return TileResult(
        job=task.job, epoch=task.epoch, step=task.step, op=task.op, gemm=task.gemm, tile=task.tile,
        attempt=task.attempt, worker_id=worker_id, out=codec.tensor_to_data(out), compute_s=time.perf_counter() - start,
    )


def reply_to(task: TileTask, worker_id: str, **fields: object) -> TileResult:
    """A result that carries no block: a cache miss or an error."""
    return TileResult(
        job=task.job, epoch=task.epoch, step=task.step, op=task.op, gemm=task.gemm, tile=task.tile,
        attempt=task.attempt, worker_id=worker_id, **fields,
    )


def measure_flops(n: int = 512, reps: int = 5) -> float:
    """Sustained fp32 GEMM FLOP/s on this device (best of a few runs of an n x n product)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / max(best, 1e-9)
