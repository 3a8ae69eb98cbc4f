"""How many threads a process multiplies with, in every thread it hands work to; and the other ways a machine may
multiply the same numbers (`spread_runs`), which measure PyTorch's own run-to-run spread."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor


def use_threads(threads: int) -> None:
    """Multiply with `threads` intra-op threads here and in every thread the running loop hands work to
    (`asyncio.to_thread`): torch's setting reaches OpenMP for the calling thread only, so a thread of the default
    executor would use every core, and a product there could round differently from the same product here."""
    import torch  # (the scheduler and the monitor never multiply, and start without torch)

    torch.set_num_threads(threads)
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(initializer=torch.set_num_threads,
                                                                        initargs=(threads,)))


def spread_runs() -> dict[str, dict[str, str]]:
    """Name -> environment of each run of the reference that measures PyTorch's own spread: every combination,
    but the machine's own, of one thread (1t), ATen's kernels at AVX2 width or not vectorised (avx2, novec) and
    MKL's GEMMs without AVX-512 (mkl2): how PyTorch sums on the machines a user may have (torch reads these as
    it is imported: one process a run; on a machine without AVX-512 some equal the machine's own)."""
    threads = {"": {}, "1t": {"OMP_NUM_THREADS": "1"}}
    aten = {"": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2"}, "novec": {"ATEN_CPU_CAPABILITY": "default"}}
    blas = {"": {}, "mkl2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
    return {"-".join(n for n in (t, a, b) if n): {**threads[t], **aten[a], **blas[b]}
            for t in threads for a in aten for b in blas if t or a or b}
