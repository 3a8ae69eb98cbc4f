"""The backward's transposes: PyTorch's `t.t().contiguous()` against `cleave.gemm.transpose.transposed` (the
copy a band of rows at a time), side by side on the same matrices, alternated, best of `--rounds`, at the
shapes of GPT-2's and Llama's layers; every result checked equal bit for bit.

    .venv/bin/python benchmarks/transpose.py [--rounds 10] [--out benchmarks/results/transpose.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from cleave.gemm.transpose import BAND_COLS, BAND_ROWS, band_rows, transposed

SHAPES = [(768, 768), (3072, 768), (768, 3072), (2048, 768), (2048, 3072), (8192, 1024), (4096, 2048), (8192, 4096),
          (1024, 128), (8192, 128), (8192, 384), (8192, 512)]  # the last: `small`'s activations at batch 8 and 64


def best_ms(fn, rounds: int) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", type=Path, help="write the figures here (JSON)")
    args = p.parse_args()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            t = torch.randn(*shape).to(dtype)
            assert torch.equal(transposed(t), t.t().contiguous())
            plain = banded = float("inf")
            for _ in range(2):  # alternated
                plain = min(plain, best_ms(lambda: t.t().contiguous(), args.rounds))  # noqa: B023
                banded = min(banded, best_ms(lambda: transposed(t), args.rounds))  # noqa: B023
            rows.append({"dtype": str(dtype).removeprefix("torch."), "shape": list(shape),
                         "band_rows": band_rows(shape[1]), "pytorch_ms": plain, "banded_ms": banded,
                         "ratio": plain / banded})
            print(f"{rows[-1]['dtype']:8s} {shape[0]:5d} x {shape[1]:<5d} PyTorch {plain:7.2f} ms  banded {banded:7.2f} ms"
                  f"  x{plain / banded:.2f}")
    if args.out:
        args.out.write_text(json.dumps({"band_rows": BAND_ROWS, "band_cols": BAND_COLS, "threads": torch.get_num_threads(),
                                        "rounds": args.rounds, "rows": rows, "load_average_1min_at_end": os.getloadavg()[0]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
