"""What the PS checks in a result block before it uses it (run off the event loop for large blocks): its values
are finite (unless the tile's inputs were not), and it is the product of the tile's inputs (Freivalds' check,
`cleave_ps.fleet.freivalds`). Its shape, dtype and provenance are checked before, on the event loop."""

from __future__ import annotations

import time

import numpy as np
import torch

from cleave.gemm.tiles import Tile
from cleave_ps.fleet import frames, freivalds
from cleave_ps.fleet.runs import GemmRun


def examine(run: GemmRun, t: Tile, block: np.ndarray, dtype: str, check: bool = True) -> tuple[str, float, float]:
    """(why the block is refused, '' if it is not; its worst residual over the tolerance; the CPU seconds
    Freivalds' check took) for `block` (as `frames.block` reads it) of tile `t` of `run`. A block that passes
    the check is finite (a value that is not fails it), so its values are read for finiteness only without
    the check or when it fails."""
    start = time.thread_time()
    verdict = freivalds.check(run.norms, t.r0, t.r1, t.c0, t.c1, freivalds.block_float32(block, dtype), dtype) \
        if check else None
    cpu = time.thread_time() - start if check else 0.0
    if verdict is not None and verdict.passed:
        return "", verdict.worst, cpu
    worst = verdict.worst if verdict is not None else 0.0
    if not frames.finite(block, dtype):
        if not inputs_finite(run, t) or overflowed(run, t, freivalds.block_float32(block, dtype), dtype, check):
            return "", worst, time.thread_time() - start if check else 0.0
        return "not_finite", worst, cpu
    wrong = verdict is not None and inputs_finite(run, t)  # a product of infinities cannot be checked
    return ("wrong_block" if wrong else ""), worst, cpu


def overflowed(run: GemmRun, t: Tile, c: np.ndarray, dtype: str, check: bool = True) -> bool:
    """Whether the values of half-precision block `c` (float32) that are not finite are its honest overflow:
    each an infinity where the exact product (computed here, element by element) lies beyond the dtype's
    range, with its sign, and the rest of the block the product (Freivalds' check, with the exact values in
    place of the infinities). A float16 job at a large learning rate overflows as its reference does, which
    then skips the step; refusing the block as a lie re-sent it for ever."""
    if dtype not in ("float16", "bfloat16"):
        return False
    bad = ~np.isfinite(c)
    rows, cols = np.nonzero(bad)
    if np.isnan(c[rows, cols]).any():
        return False  # (an honest sum of finite products in float32 does not make NaN)
    a = run.a[t.r0 : t.r1][torch.from_numpy(rows)].double()
    bt = run.bt[t.c0 : t.c1][torch.from_numpy(cols)].double()
    exact = (a * bt).sum(dim=1).numpy()
    limit = float(torch.finfo(freivalds.TORCH_DTYPES[dtype]).max)
    if not (np.all(np.abs(exact) > limit) and np.all(np.sign(exact) == np.sign(c[rows, cols]))):
        return False
    if not check:
        return True
    patched = c.copy()
    patched[rows, cols] = exact
    return freivalds.check(run.norms, t.r0, t.r1, t.c0, t.c1, patched, dtype).passed


def prepare(run: GemmRun) -> float:
    """The CPU seconds of computing what all of `run`'s checks share (`freivalds.Norms.ready`: its inputs' row
    norms, random vector and A·y), done once, as soon as its tiles are dealt: its first result does not wait for
    it, and it costs less there than in the first check (`benchmarks/step.py`, small: the checks' CPU about 15% less)."""
    start = time.thread_time()
    run.norms.ready()
    return time.thread_time() - start


def inputs_finite(run: GemmRun, t: Tile) -> bool:
    return bool(torch.isfinite(run.a[t.r0 : t.r1]).all() and torch.isfinite(run.bt[t.c0 : t.c1]).all())
