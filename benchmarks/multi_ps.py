"""Several PS replicas: 1 against R replicas with the same total workers, side by side in one run.

Per replica count, the same `small` job on a fresh local stack (nats-server, scheduler, N worker processes,
the PS or its replicas): the median step, the median gradient all-reduce and the wait for the slowest
replica before it (replica 0's view), the all-reduce's bytes (every gradient, fp32) and rate, the losses
against the single-process reference, and the ratio of the step times. Writes
benchmarks/results/multi_ps.json.

    nice -n 10 .venv/bin/python benchmarks/multi_ps.py [--preset small] [--steps 12] [--workers 4] [--replicas 1 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from cleave.api.fleet import LocalFleet
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer

WARMUP_STEPS = 2
RESULTS = Path(__file__).parent / "results" / "multi_ps.json"


def reference(job: JobConfig) -> tuple[list[float], float, int]:
    """Losses and the median step of the single-process run, and the model's parameter count."""
    trainer = Trainer(job)
    losses, times = [], []
    for s in range(job.steps):
        t0 = time.perf_counter()
        losses.append(trainer.step(s))
        times.append(time.perf_counter() - t0)
    return losses, statistics.median(times[WARMUP_STEPS:]), sum(p.numel() for p in trainer.model.parameters())


def distributed(job: JobConfig, workers: int, replicas: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        fleet = LocalFleet(run_dir, workers)
        try:
            fleet.start()
            fleet.start_ps(job, run_dir / "metrics.jsonl", replicas=replicas)
            return fleet.wait_ps(run_dir / "metrics.jsonl", timeout_s=1200)
        finally:
            fleet.stop()


def bench(job: JobConfig, workers: int, replicas: int, want: list[float], params: int, run: int) -> dict:
    lines = distributed(job.model_copy(update={"job_id": f"{job.job_id}-{run}-x{replicas}"}), workers, replicas)
    body = lines[WARMUP_STEPS:]
    allreduce = statistics.median(m.get("allreduce_s", 0.0) for m in body)
    grad_bytes = 4 * params if replicas > 1 else 0
    return {
        "replicas": replicas, "workers": workers, "steps": len(lines), "round": run,
        "step_s": statistics.median(m["step_time_s"] for m in body),
        "gemm_s": statistics.median(m["gemm_s"] for m in body),  # replica 0's distributed GEMMs
        "allreduce_s": allreduce, "replica_wait_s": statistics.median(m.get("replica_wait_s", 0.0) for m in body),
        "allreduce_bytes": grad_bytes, "allreduce_bytes_per_s": grad_bytes / allreduce if allreduce else None,
        "workers_in_job": statistics.median(m["workers"] for m in body),  # every replica's, summed
        "max_rel_loss_diff_vs_reference": max(abs(m["loss"] - w) / abs(w) for m, w in zip(lines, want, strict=True)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=2, help="run the replica counts in turn this many times")
    args = p.parse_args()
    job = JobConfig(job_id=f"bench-multi-ps-{int(time.time())}", preset=args.preset, steps=args.steps)
    want, ref_s, params = reference(job)
    rows = [bench(job, args.workers, r, want, params, i) for i in range(args.rounds) for r in args.replicas]
    for r in rows:  # against the first replica count of the same round, run just before it
        r["step_over_first"] = r["step_s"] / next(b["step_s"] for b in rows if b["round"] == r["round"])
        rate = f", {r['allreduce_bytes_per_s'] / 1e6:.0f} MB/s" if r["allreduce_bytes_per_s"] else ""
        print(f"{args.preset} round {r['round']}, {r['replicas']} PS x {args.workers} workers in all: "
              f"step {r['step_s']:.3f}s (GEMMs {r['gemm_s']:.3f}s) "
              f"(x{r['step_over_first']:.2f} of {args.replicas[0]} PS); all-reduce {r['allreduce_s'] * 1e3:.1f} ms"
              f" of {r['allreduce_bytes'] / 1e6:.1f} MB{rate}, wait {r['replica_wait_s'] * 1e3:.1f} ms; "
              f"losses vs reference max rel. diff {r['max_rel_loss_diff_vs_reference']:.1e}")
    ratios = [r["step_over_first"] for r in rows if r["replicas"] == args.replicas[-1]]
    doc = {"preset": args.preset, "steps": args.steps, "reference_step_s": ref_s, "parameters": params,
           "median_ratio": statistics.median(ratios), "runs": rows,
           "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=2))
    print(f"reference step {ref_s:.3f}s; {args.replicas[-1]} against {args.replicas[0]} PS: step time "
          f"x{doc['median_ratio']:.2f} (median over {args.rounds} rounds); wrote {RESULTS}")


if __name__ == "__main__":
    main()
