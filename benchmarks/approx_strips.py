"""The loss cost of approximate strips against the exact fp32 job, next to the bytes they save, side by side
in one run (docs/evaluation.md, "What closes the gap to the pipeline").

- **Real runs** on the local stack: `cleave train --preset small --workers 2 --steps N --seed S` with
  `CLEAVE_PS_TILE_DTYPE` fp32 (exact), bf16 and fp16 (the runtime's approximate mode: an fp32 job's input
  blocks rounded to 2 bytes, products in fp32), and the same job `--reference` (one process): per-step
  losses and the bytes the PS sent.
- **Offline**, one process, real torch math: the same job (same seed, batches, optimizer) with every linear
  layer's three GEMMs (`cleave.gemm.tiled`) taking their inputs rounded as the strips would travel: fp32 (no
  rounding: the offline baseline), bf16, fp16, and 8-bit strips (`cleave.compression.Int8Blockwise`: int8
  codes, one fp32 scale per block of B values, 1 + 4/B bytes an element), computed in fp32; products in
  fp32 as the runtime returns them, or (`+out`) rounded to 8-bit too, as the simulator's 8-bit lever
  assumes (one byte each way). The offline bf16 and fp16 rows check the offline model against the real runs.

Writes benchmarks/results/approx_strips.json.

    nice -n 10 .venv/bin/python benchmarks/approx_strips.py --steps 50          # ~20 min on a loaded 2-core box
    nice -n 10 .venv/bin/python benchmarks/approx_strips.py --steps 5 --offline-only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from cleave.compression import Int8Blockwise
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer

OUT = Path(__file__).parent / "results" / "approx_strips.json"
CLEAVE = Path(sys.executable).with_name("cleave")
MODES = ("fp32", "bf16", "fp16", "int8:256", "int8:64", "int8:64+out")  # offline
LAST = 10  # losses compared over the last this many steps (one step's loss is noisy)


class Rounded:
    """A GEMM backend whose inputs are rounded as strips of `mode` would travel, then multiplied in fp32."""

    def __init__(self, mode: str) -> None:
        self.mode, self.out = mode.removesuffix("+out"), mode.endswith("+out")
        self.int8 = Int8Blockwise(int(self.mode.split(":")[1])) if mode.startswith("int8") else None

    def round(self, t: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8.decompress(self.int8.compress(t)).float()
        if self.mode in ("bf16", "fp16"):
            return t.to(torch.bfloat16 if self.mode == "bf16" else torch.float16).float()
        return t.float()

    def bytes_per_element(self) -> float:
        return 1 + 4 / self.int8.block if self.int8 else {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}[self.mode]

    def gemm(self, a: torch.Tensor, bt: torch.Tensor, name: str) -> torch.Tensor:
        c = self.round(a) @ self.round(bt).t()
        return (self.round(c) if self.out else c).to(a.dtype)


def offline(mode: str, steps: int, seed: int, preset: str) -> dict:
    torch.manual_seed(seed)
    backend = Rounded(mode)
    trainer = Trainer(JobConfig.build(preset=preset, steps=steps, seed=seed, device="cpu"), backend)
    return {"mode": mode, "bytes_per_element": backend.bytes_per_element(), "products_rounded": backend.out,
            "losses": [trainer.step(s) for s in range(steps)]}


def real(mode: str, steps: int, seed: int, preset: str, workers: int, tmp: Path, reference: bool = False) -> dict:
    name = "reference" if reference else mode
    out = tmp / f"{name}.jsonl"
    cmd = [str(CLEAVE), "train", "--preset", preset, "--steps", str(steps), "--seed", str(seed),
           "--run-dir", str(tmp / name), "--metrics-out", str(out)]
    cmd += ["--reference"] if reference else ["--workers", str(workers)]
    env = {**os.environ, "CLEAVE_PS_TILE_DTYPE": mode}
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    return {"mode": name, "losses": [x["loss"] for x in lines],
            "bytes_down": sum(x.get("bytes_down", 0) for x in lines), "command": " ".join(cmd),
            "env": f"CLEAVE_PS_TILE_DTYPE={mode}"}


def against(rows: list[dict], base: dict) -> None:
    """Each row's loss difference from `base` (final step, and the mean over the last LAST steps)."""
    ref = base["losses"]
    for r in rows:
        d = [a - b for a, b in zip(r["losses"], ref, strict=True)]
        r["final_loss"], r["final_diff"] = r["losses"][-1], d[-1]
        r["last_mean_diff"] = sum(d[-LAST:]) / len(d[-LAST:])
        r["max_abs_diff"] = max(abs(x) for x in d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--offline-only", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    doc: dict = {"config": {k: str(v) for k, v in vars(args).items()}}
    off = [offline(m, args.steps, args.seed, args.preset) for m in MODES]
    against(off, off[0])
    doc["offline"] = off
    for r in off:
        print(f"offline {r['mode']:11s} {r['bytes_per_element']:5.3f} B/elem  final loss {r['final_loss']:.4f}  "
              f"diff {r['final_diff']:+.4f} (last {LAST} mean {r['last_mean_diff']:+.4f}, max |d| {r['max_abs_diff']:.4f})")
    if not args.offline_only:
        with tempfile.TemporaryDirectory(prefix="approx-strips-") as tmp:
            runs = [real(m, args.steps, args.seed, args.preset, args.workers, Path(tmp)) for m in ("fp32", "bf16", "fp16")]
            runs.append(real("fp32", args.steps, args.seed, args.preset, args.workers, Path(tmp), reference=True))
        against(runs, runs[0])
        for r in runs:
            saved = 1 - r["bytes_down"] / runs[0]["bytes_down"] if r["bytes_down"] else None
            r["bytes_down_saved"] = saved
            print(f"real {r['mode']:9s} final loss {r['final_loss']:.4f}  diff {r['final_diff']:+.4f} (last {LAST} "
                  f"mean {r['last_mean_diff']:+.4f}, max |d| {r['max_abs_diff']:.4f})  PS sent {r['bytes_down'] / 1e9:.2f} GB"
                  + (f" ({saved:.0%} saved)" if saved is not None else ""))
        doc["real"] = runs
    args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
