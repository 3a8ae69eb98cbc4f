"""The worker's pure core: the bounded input-block cache, the checks on a tile (shapes, dtypes, memory
budget), the computation of one tile and the FLOPS measurement, all on the device the worker computes on.

On CUDA, blocks arrive in page-locked (pinned) host memory and go to the GPU with a non-blocking copy that
the tile's product, queued behind it on the same stream, waits for; cached blocks stay on the GPU (the
cache's budget counts their device bytes); a result comes back through pinned memory, synchronised on an
event before its bytes are encoded. On the CPU the same functions run with no copies at all.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
import torch

from cleave import codec
from cleave.gemm import tiles
from cleave.plan.costmodel import tile_memory_bytes
from cleave.schemas import COMPUTE_DTYPE_BYTES, BlockRef, TileResult, TileTask

HALF = (torch.float16, torch.bfloat16)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # workers use CUDA when present
FLOPS_N = {"cpu": 512, "cuda": 4096}  # side of the measured product: a GPU needs a large one to be busy
FLOPS_RUN_S = 0.03  # on a CPU each timed product of the FLOPS probe lasts about this long: several periods of a
# CPU share (cleave.runtime.netlab: 10 ms) or time slices of a busy machine, so none is caught whole in a lucky one
MAX_FLOPS_N = 2048  # ... and is at most this square (0.2 s at 80 GFLOP/s)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU without blocking (pinned `t`: the copy overlaps the host's work)."""
    return t if t.device == device else t.to(device, non_blocking=t.is_pinned())


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values in host memory: from a GPU through a pinned buffer, synchronised on an event that
    waits for this copy only (other threads' products on the same GPU go on)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    done.synchronize()
    return host


def nbytes(t: torch.Tensor) -> int:
    """What a tensor holds on its device: its whole storage (a view keeps all of it alive)."""
    return t.untyped_storage().nbytes()


class BlockCache:
    """Least-recently-used input blocks on `device`, bounded in the bytes they hold there."""

    def __init__(self, capacity_bytes: int, device: torch.device = DEVICE) -> None:
        self.capacity, self.device = capacity_bytes, torch.device(device)
        self.used = 0
        self._blocks: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, block_id: str) -> torch.Tensor | None:
        t = self._blocks.get(block_id)
        if t is not None:
            self._blocks.move_to_end(block_id)
        return t

    def put(self, block_id: str, t: torch.Tensor) -> None:
        size = nbytes(t)
        if size > self.capacity or block_id in self._blocks:
            return
        while self.used + size > self.capacity:
            _, old = self._blocks.popitem(last=False)
            self.used -= nbytes(old)
        self._blocks[block_id] = t
        self.used += size

    def resolve(self, ref: BlockRef) -> torch.Tensor | None:
        if getattr(ref, "parts", ()):  # a block sent as segments of its rows: their concatenation
            got = [self.resolve(p) for p in ref.parts]
            return None if any(t is None for t in got) else torch.cat(got)
        if ref.tensor is not None:
            # (on the CPU the block is read where msgpack put it; for a GPU it goes through pinned memory)
            t = to_device(codec.data_to_tensor(ref.tensor, pin=True), self.device) if self.device.type == "cuda" \
                else codec.data_view(ref.tensor)
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
    return int(tile_memory_bytes(np.array(a.shape[0]), np.array(bt.shape[0]), a.shape[1], COMPUTE_DTYPE_BYTES))


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
    """Multiply one tile's blocks on the device they are on (a small CPU tile on the event loop, others off it,
    `cleave_worker.tiles.INLINE_S`); `compute_s` includes the copy of the result to the host. `corrupt`
    makes a lying worker for tests."""
    start = time.perf_counter()
    if a.dtype in HALF:  # the approximate mode sends half-precision inputs; products accumulate in float32
        a, bt = a.float(), bt.float()
    out = tiles.compute(a, to_device(bt, a.device))
    out = to_host(out.to(codec.torch_dtype(task.rounded)) if task.rounded else out)
    if corrupt:
        out[0, 0] += corrupt
    return TileResult(
        job=task.job, epoch=task.epoch, step=task.step, op=task.op, gemm=task.gemm, tile=task.tile,
        attempt=task.attempt, worker_id=worker_id, out=codec.tensor_view(out), compute_s=time.perf_counter() - start,
    )


def reply_to(task: TileTask, worker_id: str, **fields: object) -> TileResult:
    """A result that carries no block: a cache miss or an error."""
    return TileResult(
        job=task.job, epoch=task.epoch, step=task.step, op=task.op, gemm=task.gemm, tile=task.tile,
        attempt=task.attempt, worker_id=worker_id, **fields,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_flops(n: int | None = None, reps: int = 5, device: torch.device = DEVICE) -> float:
    """Sustained fp32 GEMM FLOP/s on the device tiles are computed on: the best of `reps` runs of an n x n
    product (on CUDA each run is timed between synchronisations, so the kernel is counted, not its launch).
    Without `n`, on a CPU the product grows from 512 x 512 until even the best run lasts FLOPS_RUN_S: the
    512 x 512 product lasts 3 ms at 80 GFLOP/s, short enough to fall inside one time slice of a shared or
    capped CPU and report the core's peak, not what the device sustains (the emulated devices of
    benchmarks/real_links.py, on the same two cores, measured 14-99 GFLOP/s). A device slower than 9 GFLOP/s
    measures at 512 x 512."""
    device = torch.device(device)
    if n is None and device.type == "cpu":
        n = FLOPS_N["cpu"]
        while True:
            flops = _best_flops(n, reps, device, FLOPS_RUN_S if n < MAX_FLOPS_N else 0.0)
            run_s = 2 * n**3 / flops
            if run_s >= FLOPS_RUN_S or n >= MAX_FLOPS_N:
                return flops
            n = min(MAX_FLOPS_N, int(n * max(1.25, (FLOPS_RUN_S / run_s) ** (1 / 3))))
    return _best_flops(n or FLOPS_N.get(device.type, FLOPS_N["cpu"]), reps, device)


def _best_flops(n: int, reps: int, device: torch.device, short_s: float = 0.0) -> float:
    """The best of `reps` timed n x n products, or of fewer once one lasts less than `short_s` (the size is
    then too small to be measured: `measure_flops` grows it, and the other runs would change nothing)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b  # warm-up (on CUDA also the library's handle and the kernel choice)
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
        if best < short_s:
            break
    return 2 * n**3 / max(best, 1e-9)
