"""A fresh GEMM output filled with result blocks, its pages faulted by the copies themselves against populated
first in one call (`cleave_ps.fleet.prefault`), in 4 KiB pages and in transparent huge pages, side by side: the
milliseconds of each (and of populating alone), alternated, best of `--rounds`. The output is 4096 x 4096 float32 (64 MiB) filled by sixteen 1024 x 1024 blocks, as in
`benchmarks/ps_rate.py`.

    .venv/bin/python benchmarks/prefault.py [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from cleave_ps.fleet import prefault
from cleave_ps.jobs.pretrain import return_freed_memory

N, TILE = 4096, 1024


def fill(out: torch.Tensor, block: np.ndarray) -> None:
    a = out.numpy()
    for r in range(0, N, TILE):
        for c in range(0, N, TILE):
            a[r:r + TILE, c:c + TILE] = block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the figures here (JSON)")
    args = p.parse_args()
    return_freed_memory()  # as the PS runs: a 64 MiB tensor is mapped fresh every time
    block = np.ones((TILE, TILE), np.float32)
    kinds = {"faulted by the copies": None, "populated, then copied": False,
             "populated in huge pages, then copied": True}  # -> prefault's `huge`
    best = dict.fromkeys(kinds, float("inf"))
    populate = dict.fromkeys(kinds, float("inf"))
    for _ in range(args.rounds):
        for name, huge in kinds.items():
            out = torch.empty(N, N)
            t0 = time.perf_counter()
            if huge is not None and not prefault.prefault(out, huge):
                raise SystemExit("madvise(MADV_POPULATE_WRITE) is not available here (Linux 5.14 or later)")
            t1 = time.perf_counter()
            fill(out, block)
            best[name] = min(best[name], time.perf_counter() - t0)
            populate[name] = min(populate[name], t1 - t0)
            del out
    for name, s in best.items():
        print(f"{name:38s} {1e3 * s:6.1f} ms (populating {1e3 * populate[name]:5.1f} ms)")
    ratio = best["faulted by the copies"] / best["populated in huge pages, then copied"]
    print(f"faulted / populated in huge pages: {ratio:.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"output_bytes": N * N * 4, "block_bytes": TILE * TILE * 4,
                                        "rounds": args.rounds, "faulted_by_copies_s": best["faulted by the copies"],
                                        "populated_then_copied_s": best["populated, then copied"],
                                        "huge_populated_then_copied_s": best["populated in huge pages, then copied"],
                                        "populating_s": populate["populated, then copied"],
                                        "huge_populating_s": populate["populated in huge pages, then copied"],
                                        "ratio": ratio, "load_average_1min_at_end": os.getloadavg()[0]},
                                       indent=2) + "\n")


if __name__ == "__main__":
    main()
