"""GEMM outputs in memory the PS has used before.

An output of `MAPPED_BYTES` or more is memory glibc maps for it alone and unmaps when it is freed
(`cleave.runtime.memory`), so every fresh one costs the kernel zeroing its pages: in `benchmarks/ps_rate.py` a
quarter of the PS's CPU (docs/evaluation.md). The pool keeps the buffers of such outputs, up to `cap` bytes
(`product_pool_bytes`), and hands one out again for an output of the same shape and dtype once nothing holds its
memory any more: no tensor, view, tensor autograd saved, numpy array or storage object shares it. torch counts
the holders of a storage (its use count, and the Python references to its storage object); a buffer is free when
both are what a lone tensor shows (measured once, on a tensor of its own). An output is handed out as a view of
its buffer, a tensor of its own, so whoever keeps it is counted. Free buffers stay resident: at most `cap`
bytes, which the preflight takes from the memory a job leaves (`cleave.train.preflight.spare_pool`); the least
recently used ones make way for a shape the pool lacks. Outputs in page-locked memory (a CUDA PS's: the CUDA
allocator caches those) and builds of torch without the count get fresh memory.
"""

from __future__ import annotations

import functools
import sys

import torch

from cleave.runtime.memory import MAPPED_BYTES


def _holders(t: torch.Tensor) -> tuple[int, int]:
    """What holds `t`'s memory: the storage's use count and its storage object's Python references."""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)


@functools.cache
def _alone() -> tuple[int, int] | None:
    """`_holders` of a tensor nothing else holds; None where this torch cannot count them."""
    try:
        return _holders(torch.empty(1))
    except (AttributeError, TypeError):  # (a private function of torch: gone or changed in another version)
        return None


class Products:
    def __init__(self, cap: int, smallest: int = MAPPED_BYTES) -> None:
        self.cap = cap if _alone() is not None else 0
        self.smallest = smallest  # smaller outputs come from the heap's reused memory
        self.buffers: list[torch.Tensor] = []  # the least recently handed out first
        self.reused = self.fresh = 0  # outputs of the pool's sizes handed out from a buffer, and newly allocated

    @property
    def held(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def free(self, buffer: torch.Tensor) -> bool:
        return _holders(buffer) == _alone()

    def take(self, m: int, n: int, dtype: torch.dtype, pin: bool = False) -> tuple[torch.Tensor, bool]:
        """An m x n output of `dtype` (contents undefined, as `torch.empty`'s), and whether its memory is new."""
        nbytes = m * n * dtype.itemsize
        if pin or not self.smallest <= nbytes <= self.cap:
            return torch.empty(m, n, dtype=dtype, pin_memory=pin), True
        for i, buf in enumerate(self.buffers):
            if buf.shape == (m, n) and buf.dtype == dtype and self.free(buf):
                self.buffers.append(self.buffers.pop(i))
                self.reused += 1
                return buf.view(m, n), False
        self._make_room(self.cap - nbytes)
        buf = torch.empty(m, n, dtype=dtype)
        if self.held + nbytes <= self.cap:
            self.buffers.append(buf)
        self.fresh += 1
        return buf.view(m, n), True

    def _make_room(self, room: int) -> None:
        """Drop the least recently used free buffers (their memory goes back to the OS) until the pool holds at
        most `room` bytes, or none is free."""
        keep, held = [], self.held
        for buf in self.buffers:
            if held > room and self.free(buf):
                held -= buf.nbytes
            else:
                keep.append(buf)
        self.buffers = keep
