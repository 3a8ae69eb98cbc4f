"""The worker's pure core: the bounded input-block cache and the computation of one tile."""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from cleave import codec, tiles
from cleave.schemas import BlockRef, TileResult, TileTask

HALF = (torch.float16, torch.bfloat16)
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


def check_inputs(a: torch.Tensor, bt: torch.Tensor) -> str:
    """Why these blocks cannot be multiplied, or '' when they can."""
    if a.dim() != 2 or bt.dim() != 2:
        return f"blocks must be 2-D, got {tuple(a.shape)} and {tuple(bt.shape)}"
    if a.shape[1] != bt.shape[1]:
        return f"inner dimensions differ: {a.shape[1]} vs {bt.shape[1]}"
    if a.dtype != bt.dtype or not a.dtype.is_floating_point:
        return f"dtypes {a.dtype} and {bt.dtype} must be one floating type"
    if a.dtype == torch.float64:
        return "float64 blocks are not computed"
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
