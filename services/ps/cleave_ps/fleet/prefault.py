"""A GEMM's output made present in memory before its blocks arrive.

A fresh output of a MiB or more is memory the PS has just mapped (glibc maps such allocations on their own,
`cleave.runtime.memory.MAPPED_BYTES`; a freed output's memory is reused where it can be, `products`), and each
of its pages faults on the first write of a block into it: on the event loop's copy, one trap per 4 KiB page.
Linux (5.14 and later) populates a whole range in one system call, `madvise(MADV_POPULATE_WRITE)`, which the PS
makes in a thread as the GEMM starts, while its tiles are still out at the workers, after asking for the range
in transparent huge pages (`madvise(MADV_HUGEPAGE)`: 2 MiB pages, 512 times fewer to map and zero one by one,
where the kernel has them; else in 4 KiB pages). The figures for a 64 MiB output filled by 4 MiB blocks are in
docs/evaluation.md ("The PS's byte rate", `benchmarks/prefault.py`). The calls leave the memory's contents as
they are; elsewhere (another OS, an older kernel) they are skipped.
"""

from __future__ import annotations

import ctypes
import functools
import mmap

import torch

from cleave.runtime.memory import MAPPED_BYTES

MADV_HUGEPAGE = 14  # linux/mman.h: this range in transparent huge pages where the kernel allows them
MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+)
MIN_BYTES = MAPPED_BYTES  # smaller outputs come from the heap, mostly present already


@functools.cache
def _madvise():  # noqa: ANN202 - libc's madvise, or None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def wanted(t: torch.Tensor) -> bool:
    """Whether `t` is worth populating: a CPU tensor of MIN_BYTES or more where madvise exists."""
    return t.device.type == "cpu" and t.numel() * t.element_size() >= MIN_BYTES and _madvise() is not None


def prefault(t: torch.Tensor, huge: bool = True) -> bool:
    """Populate the pages under `t` writable, in huge pages where the kernel has them and `huge` (the GIL is
    released during the calls); False where the kernel refuses (older than 5.14, or memory it cannot
    populate), which changes nothing."""
    fn = _madvise()
    if fn is None:
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    start -= start % mmap.PAGESIZE
    if huge and not t.is_pinned():  # (page-locked memory, a CUDA PS's, is the CUDA allocator's: left as it is)
        fn(start, end - start, MADV_HUGEPAGE)  # (refused where the kernel has no huge pages: small ones then)
    return fn(start, end - start, MADV_POPULATE_WRITE) == 0
