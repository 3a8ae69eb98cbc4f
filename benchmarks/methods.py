"""The data-parallel methods side by side on a real local stack: round time, bytes and loss, calm and churned.

For each worker count, in one run, on the same preset, data and AdamW settings:
- `diloco` with the defaults (cleave.train.job: H, outer lr, momentum), `diloco` with the DiLoCo paper's outer
  step (lr 0.7, Nesterov 0.9) at the same H, and `fedavg` (E = H, server lr 1: plain averaging);
- each calm, and again with one worker SIGKILLed as the middle round reaches it (a fault point in the worker,
  so the kill lands at the same place every run): the seconds that round took, and its recovery event.
Reported per configuration: median round wall time, bytes per round down (at the PS and per worker) and up
(at the PS and per worker), the validation loss after the last round. Writes benchmarks/results/methods.json.

    nice -n 10 .venv/bin/python benchmarks/methods.py [--preset small] [--rounds 20] [--workers 2 4]
        [--local-steps 10] [--no-kill]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from cleave.api.fleet import LocalFleet
from cleave.train.job import DEFAULT_LOCAL_STEPS, JobConfig

RESULTS = Path(__file__).parent / "results" / "methods.json"
CONFIGS = {  # name -> job fields besides preset, rounds and H
    "diloco": dict(method="diloco"),
    "diloco-paper-outer": dict(method="diloco", outer_lr=0.7, outer_momentum=0.9),
    "fedavg": dict(method="fedavg"),
}
JOB_TIMEOUT_S = 3600


def run(run_dir: Path, job: JobConfig, workers: int, kill_at: int | None) -> list[dict]:
    """The job on `workers` workers; with `kill_at`, one of them SIGKILLs itself as round `kill_at` reaches it."""
    fleet = LocalFleet(run_dir, workers - (kill_at is not None))
    try:
        fleet.start()
        if kill_at is not None:
            fleet.stack.service("victim", "worker", ["--worker-id", "victim"], restart=False,
                                env={"CLEAVE_WORKER_FAIL_AT": f"round:{kill_at}",
                                     "CLEAVE_WORKER_FAULT_DIR": str(run_dir / "faults")})
        fleet.start_ps(job, run_dir / "m.jsonl")
        return fleet.wait_ps(run_dir / "m.jsonl", timeout_s=JOB_TIMEOUT_S)
    finally:
        fleet.stop()


def summary(lines: list[dict], kill_at: int | None) -> dict:
    per = lambda total, n: total / n if n else 0.0  # noqa: E731
    out = {
        "rounds": len(lines),
        "median_round_s": statistics.median(m["step_time_s"] for m in lines),
        "bytes_down_ps": statistics.fmean(m["bytes_down"] for m in lines),
        "bytes_down_per_worker": statistics.fmean(m["bytes_down_per_worker"] for m in lines),
        "bytes_up_ps": statistics.fmean(m["bytes_up"] for m in lines),
        "bytes_up_per_worker": statistics.fmean(per(m["bytes_up"], m["updates"]) for m in lines),
        "val_loss": lines[-1]["val_loss"],
        "workers": [m["workers"] for m in lines],
    }
    if kill_at is not None:
        hit = next((m for m in lines if m["recovery"]), None)
        out["kill_round"] = kill_at
        out["recovery"] = hit["recovery"] if hit else []
        out["kill_round_s"] = hit["step_time_s"] if hit else None  # from the kill (as the round began) to its end
    return out


def table(results: list[dict]) -> str:
    rows = [f"{'config':<20} {'N':>2} {'kill':>4} {'round s':>8} {'down PS KB':>10} {'down/w KB':>9} "
            f"{'up PS KB':>9} {'up/w KB':>8} {'val loss':>8} {'kill round s':>12}"]
    for r in results:
        k = r.get("kill_round_s")
        rows.append(f"{r['config']:<20} {r['n']:>2} {'yes' if 'kill_round' in r else 'no':>4} "
                    f"{r['median_round_s']:>8.2f} {r['bytes_down_ps'] / 1e3:>10.1f} "
                    f"{r['bytes_down_per_worker'] / 1e3:>9.1f} {r['bytes_up_ps'] / 1e3:>9.1f} "
                    f"{r['bytes_up_per_worker'] / 1e3:>8.1f} {r['val_loss']:>8.4f} "
                    f"{'' if k is None else f'{k:.2f}':>12}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--local-steps", type=int, default=DEFAULT_LOCAL_STEPS)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--no-kill", action="store_true", help="calm runs only")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="cleave-methods-") as tmp:
        for n in args.workers:
            for name in args.configs:
                for kill_at in (None,) if args.no_kill else (None, args.rounds // 2):
                    job = JobConfig(job_id=f"{name}-{n}-{'kill' if kill_at is not None else 'calm'}-{time.time_ns()}",
                                    preset=args.preset, steps=args.rounds, local_steps=args.local_steps,
                                    val_every=args.rounds, **CONFIGS[name])
                    lines = run(Path(tmp) / job.job_id, job, n, kill_at)
                    results.append({"config": name, "n": n, **summary(lines, kill_at)})
                    print(table(results[-1:]).splitlines()[-1], flush=True)
    print(f"{args.preset}, {args.rounds} rounds, H={args.local_steps}, batch {JobConfig().batch_size}")
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"preset": args.preset, "rounds": args.rounds, "local_steps": args.local_steps,
                                    "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
