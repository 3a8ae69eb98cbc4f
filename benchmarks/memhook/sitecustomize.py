"""Benchmark-only: every Python process that benchmarks/gpu.py starts has this folder on its PYTHONPATH, so
it records at exit its peak memory into $CLEAVE_BENCH_MEMORY_DIR/<pid>.json: peak RSS from the kernel, and,
when the process used CUDA, `torch.cuda.max_memory_allocated` / `max_memory_reserved` and the GPU's name.
Without that variable (any other run) it does nothing; it imports nothing heavy."""

from __future__ import annotations

import atexit
import json
import os
import resource
import sys


def _record() -> None:
    doc = {"pid": os.getpid(), "argv": sys.argv[1:3],
           "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        doc.update(device=torch.cuda.get_device_name(), cuda_max_allocated_bytes=torch.cuda.max_memory_allocated(),
                   cuda_max_reserved_bytes=torch.cuda.max_memory_reserved())
    with open(os.path.join(os.environ["CLEAVE_BENCH_MEMORY_DIR"], f"{os.getpid()}.json"), "w") as f:
        json.dump(doc, f)


if os.environ.get("CLEAVE_BENCH_MEMORY_DIR"):
    atexit.register(_record)
