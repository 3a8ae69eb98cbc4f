"""DiLoCo's outer optimizer and H on a built-in preset: which defaults learn, against plain averaging.

In one process (the same math the PS and workers run: `cleave.methods.diloco`, one model per worker on its
own shard, inner AdamW kept across rounds), every (H, outer lr, outer momentum) of a small grid trains the
same number of local steps per worker (rounds = steps / H), and reports the validation loss after the last
round. Plain averaging (outer lr 1, no momentum: what FedAvg does) and the DiLoCo paper's outer step
(lr 0.7, Nesterov 0.9) are in the grid; the table shows each setting's loss against plain averaging at the
same H. Writes benchmarks/results/diloco_grid.json.

    nice -n 10 .venv/bin/python benchmarks/diloco_grid.py [--preset small] [--workers 2] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from compression import run_diloco

from cleave.methods import diloco
from cleave.train.data import Corpus
from cleave.train.job import JobConfig

RESULTS = Path(__file__).parent / "results" / "diloco_grid.json"
DEFAULT_H = (5, 10, 20)
DEFAULT_OUTER = ("1:0", "0.7:0.9", "1:0.5", "0.8:0.5", "1:0.3", "1.2:0")  # outer lr : momentum; 1:0 is plain


def save(args: argparse.Namespace, job: JobConfig, runs: list[dict]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"preset": args.preset, "workers": args.workers, "steps": args.steps,
                                   "batch_size": job.batch_size, "lr": job.lr, "runs": runs}, indent=2))


def grid(args: argparse.Namespace, job: JobConfig, corpus: Corpus, runs: list[dict]) -> list[dict]:
    """Every (H, outer) of the grid not in `runs` yet; the JSON is rewritten after each, so a long grid
    on a busy machine can be stopped and continued with --resume."""
    done = {(r["H"], r["outer_lr"], r["outer_momentum"]) for r in runs}
    workers, steps = args.workers, args.steps
    for h in args.h:
        rounds = max(1, steps // h)
        for spec in args.outer:
            lr, mom = (float(x) for x in spec.split(":"))
            if (h, lr, mom) in done:
                continue
            cfg = diloco.DilocoConfig(inner_steps=h, outer_lr=lr, outer_momentum=mom)
            t0 = time.perf_counter()
            r = run_diloco("none", job, corpus, workers, h, rounds, cfg)
            runs.append({"H": h, "rounds": rounds, "outer_lr": lr, "outer_momentum": mom,
                         "val_loss": r["val_loss"], "seconds": time.perf_counter() - t0})
            print(f"H={h:<3} rounds={rounds:<4} outer lr={lr:<4g} momentum={mom:<4g} "
                  f"val loss {r['val_loss']:.4f} ({runs[-1]['seconds']:.0f}s)", flush=True)
            save(args, job, runs)
    return runs


def table(runs: list[dict]) -> str:
    plain = {r["H"]: r["val_loss"] for r in runs if r["outer_lr"] == 1 and r["outer_momentum"] == 0}
    rows = [f"{'H':>3} {'rounds':>6} {'outer lr':>8} {'momentum':>8} {'val loss':>9} {'vs plain':>9}"]
    for r in sorted(runs, key=lambda r: (r["H"], r["val_loss"])):
        base = plain.get(r["H"])
        vs = f"{r['val_loss'] - base:+9.4f}" if base is not None else f"{'':>9}"
        rows.append(f"{r['H']:>3} {r['rounds']:>6} {r['outer_lr']:>8g} {r['outer_momentum']:>8g} "
                    f"{r['val_loss']:>9.4f} {vs}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200, help="local steps per worker (rounds = steps / H)")
    ap.add_argument("--h", type=int, nargs="+", default=list(DEFAULT_H))
    ap.add_argument("--outer", nargs="+", default=list(DEFAULT_OUTER), help="LR:MOMENTUM pairs")
    ap.add_argument("--resume", action="store_true", help="keep the runs already in the JSON (same preset)")
    args = ap.parse_args()
    job, corpus = JobConfig(preset=args.preset), Corpus()
    runs = json.loads(RESULTS.read_text())["runs"] if args.resume and RESULTS.exists() else []
    runs = grid(args, job, corpus, runs)
    print(f"DiLoCo on {args.preset}: {args.workers} workers, {args.steps} local steps per worker, "
          f"batch {job.batch_size}, inner AdamW lr {job.lr}")
    print(table(runs))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
