"""What Freivalds' check of a result block (`cleave_ps.fleet.freivalds`) tells apart: how far honest blocks
stay below the tolerance, and from what size one wrong element is caught, per tile shape and dtype.

Inputs are Gaussian (a ~ N(0, 1), bt ~ N(0, 1)); an honest block is the BLAS product rounded to the dtype.
A lie adds δ to one element; it is "caught from" the smallest δ (relative to the block's root mean square,
found by bisection) that fails the check for every one of `--tries` fresh random vectors. Prints a table;
docs/security.md quotes it.

    .venv/bin/python benchmarks/freivalds_reach.py [--tries 20]
"""

from __future__ import annotations

import argparse

import torch

from cleave import codec
from cleave_ps.fleet import freivalds

SHAPES = [(64, 64, 64), (256, 256, 1024), (1024, 1024, 4096)]
DTYPES = [torch.float32, torch.bfloat16]


def verdict(a: torch.Tensor, bt: torch.Tensor, block: torch.Tensor) -> freivalds.Verdict:
    """The check of `block` as the first of a new GEMM run: with a random vector of its own."""
    dtype = codec.dtype_name(block.dtype)
    raw = (block.view(torch.int16) if block.dtype == torch.bfloat16 else block).numpy()
    return freivalds.check(freivalds.Norms(a, bt), 0, block.shape[0], 0, block.shape[1],
                           freivalds.block_float32(raw, dtype), dtype)


def caught_from(a: torch.Tensor, bt: torch.Tensor, block: torch.Tensor, tries: int) -> float:
    """The smallest δ / rms that every one of `tries` checks catches (one element, the middle row)."""
    rms = float(block.float().pow(2).mean().sqrt())
    r, c = block.shape[0] // 2, block.shape[1] - 1

    def caught(rel: float) -> bool:
        lie = block.clone()
        lie[r, c] = (lie[r, c].float() + rel * rms).to(block.dtype)
        return lie[r, c] != block[r, c] and not any(verdict(a, bt, lie).passed for _ in range(tries))

    lo, hi = 0.0, 1.0
    while not caught(hi):
        lo, hi = hi, hi * 4
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if caught(mid) else (mid, hi)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=20)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"{'tile':>22} {'dtype':>9} {'honest worst / tolerance':>25} {'one wrong element caught from (x rms)':>38}")
    for rows, cols, k in SHAPES:
        a, bt = torch.randn(rows, k, generator=g), torch.randn(cols, k, generator=g)
        product = a @ bt.T
        for dtype in DTYPES:
            block = product.to(dtype)
            honest = max(verdict(a, bt, block).worst for _ in range(args.tries))
            print(f"{f'{rows} x {cols}, K = {k}':>22} {codec.dtype_name(dtype):>9} {honest:>25.3f} "
                  f"{caught_from(a, bt, block, args.tries):>38.3g}")


if __name__ == "__main__":
    main()
