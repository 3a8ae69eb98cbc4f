"""Whether this machine's BLAS rounds a block of a product as it rounds the same rows and columns of the whole
product: the fleet computes each tile as its own GEMM (the inner dimension whole), the reference computes the
whole GEMM at once, and the two agree bit for bit only where the library sums each element in the same order
whatever the shape (float addition is not associative).

For each inner dimension k and thread count: A (512 x k) and B (512 x k) of the same seed, the whole product
A . Bᵀ, and every block of rows x cols from the list below taken from its corner, computed alone; counts the
blocks bitwise equal to the whole product's corner. Writes benchmarks/results/blas_shapes.json.

    .venv/bin/python benchmarks/blas_shapes.py [--ks 128 512 1024 3072] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "blas_shapes.json"
SIDES = (1, 2, 3, 4, 8, 15, 16, 17, 31, 32, 64, 100, 128, 200, 256, 512)


def equal_blocks(k: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, k, generator=gen), torch.randn(512, k, generator=gen)
    whole = a @ b.T
    differ = [(r, c) for r in SIDES for c in SIDES if not torch.equal(a[:r] @ b[:c].T, whole[:r, :c])]
    return {"k": k, "threads": threads, "blocks": len(SIDES) ** 2, "equal": len(SIDES) ** 2 - len(differ),
            "equal_at_least_16": sum(1 for r in SIDES for c in SIDES if min(r, c) >= 16 and (r, c) not in differ),
            "blocks_at_least_16": sum(1 for r in SIDES for c in SIDES if min(r, c) >= 16),
            "tile_256_equal": (256, 256) not in differ, "differ": " ".join(f"{r}x{c}" for r, c in differ)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", nargs="+", type=int, default=[128, 512, 1024, 3072])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    rows = [equal_blocks(k, t) for t in args.threads for k in args.ks]
    for r in rows:
        print(f"k {r['k']:5d}, {r['threads']} thread(s): {r['equal']}/{r['blocks']} blocks bitwise equal to the whole "
              f"product's ({r['equal_at_least_16']}/{r['blocks_at_least_16']} of those at least 16 x 16; "
              f"256 x 256: {'equal' if r['tile_256_equal'] else 'differs'})")
    blas = next((line.strip() for line in torch.__config__.show().splitlines() if "Math Kernel" in line or "BLAS" in line), "")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.machine(), "torch": torch.__version__, "blas": blas,
                                    "sides": SIDES, "results": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
