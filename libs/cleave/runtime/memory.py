"""A process's resident memory as the kernel counts it (its peak so far and its size now), and the PS's rules
for the memory of its largest tensors."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

MAPPED_BYTES = 1 << 20  # the PS has glibc map every allocation from this size up on its own and unmap it when
# freed (cleave_ps.jobs.pretrain.return_freed_memory): each such tensor's pages are new, zeroed by the kernel
DEFAULT_PRODUCT_POOL_BYTES = 256 * 1024 * 1024  # freed GEMM outputs of MAPPED_BYTES or more the PS keeps resident
# to reuse (cleave_ps.fleet.products; its setting product_pool_bytes), only in memory the job leaves (preflight)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far: VmHWM where /proc has it (Linux's `ru_maxrss` starts at the
    peak of the process that started this one: a PS whose own peak stayed below its starter's reported the
    starter's, and its checkpoint staging counted that memory as taken), else `ru_maxrss` (bytes on macOS)."""
    if peak := resident()[0]:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def resident(pid: int | str = "self") -> tuple[int, int]:
    """Process `pid`'s peak resident bytes so far and its resident bytes now (VmHWM, VmRSS of its
    /proc/PID/status: Linux only; a peak reset through /proc/PID/clear_refs counts from the reset); (0, 0)
    once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0, 0
    kib = {key: int(rest.split()[0]) for key, _, rest in (line.partition(":") for line in status.splitlines())
           if key in ("VmHWM", "VmRSS")}
    return kib.get("VmHWM", 0) * 1024, kib.get("VmRSS", 0) * 1024
