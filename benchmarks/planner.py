"""Planner benchmark: plan time and gap to the lower bound at 100, 1,000 and 10,000 devices, and the
predicted step time of the plan against the naive even split over every device, side by side.

Fleets are drawn from the literature's edge profile (`cleave.plan.fleet.synthetic_fleet`, seed 0). Every GEMM
kind of each model's training step is planned (`plan_model`); the GEMM shapes come from the model zoo and
are built before the clock starts. Times are wall-clock and CPU seconds of this process; on a shared
machine the CPU figure is the one other processes do not inflate. Writes benchmarks/results/planner.json.

    .venv/bin/python benchmarks/planner.py [--sizes 100 1000 10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from cleave.models import gemm_shapes, get_preset
from cleave.plan.fleet import synthetic_fleet
from cleave.plan.planner import ModelPlan, even_split_model, plan_model

JOBS = [("gpt2-medium", 8), ("gpt2-medium", 128), ("llama3-1b", 8), ("llama3-1b", 128), ("opt-1.3b", 32)]
SEQ = 1024
DTYPE_BYTES = 2  # fp16
PS_BANDWIDTH = 1.25e9  # 10 Gbit/s, for the run with a PS egress limit
OUT = Path(__file__).resolve().parent / "results" / "planner.json"


def best_of(repeat: int, fleet, shapes, ps_bandwidth: float | None) -> tuple[ModelPlan, float, float]:
    """A plan and the least wall and CPU seconds of `repeat` identical runs (the plans are identical)."""
    plans = [plan_model(fleet, shapes, DTYPE_BYTES, ps_bandwidth) for _ in range(repeat)]
    return plans[0], min(p.plan_time_s for p in plans), min(p.plan_cpu_s for p in plans)


def row(size: int, model: str, batch: int, timed: tuple[ModelPlan, float, float], even: ModelPlan) -> dict:
    plan, wall, cpu = timed
    worst = max(plan.gemms, key=lambda g: g.gap)
    return {
        "devices": size,
        "model": model,
        "batch": batch,
        "seq": SEQ,
        "gemm_kinds": len(plan.gemms),
        "ps_bandwidth": plan.ps_bandwidth,
        "plan_time_s": wall,
        "plan_cpu_s": cpu,
        "predicted_step_s": plan.predicted_step_s,
        "lower_bound_s": plan.lower_bound_s,
        "step_gap": plan.gap,
        "max_gemm_gap": worst.gap,
        "max_gap_gemm": worst.name,
        "mean_gemm_gap": float(np.mean([g.gap for g in plan.gemms])),
        "devices_used": plan.devices_used,
        "even_split_step_s": even.predicted_step_s,
        "even_split_ratio": even.predicted_step_s / plan.predicted_step_s,
    }


def measure(sizes: list[int], repeat: int) -> list[dict]:
    """One row per (fleet size, job), printed as it is measured."""
    shapes = {(m, b): gemm_shapes(get_preset(m), b, SEQ) for m, b in JOBS}  # built before any clock starts
    print(
        f"{'devices':>7} {'model':<12} {'batch':>5} {'PS B/s':>8} {'wall s':>7} {'cpu s':>6} {'step s':>9} "
        f"{'bound s':>9} {'gap':>6} {'max gap':>8} {'used':>6} {'even/plan':>9}"
    )
    rows = []
    for size in sizes:
        fleet = synthetic_fleet(size, seed=0)
        for model, batch, ps in [(m, b, None) for m, b in JOBS] + [(*JOBS[2], PS_BANDWIDTH)]:
            timed = best_of(repeat, fleet, shapes[(model, batch)], ps)
            even = even_split_model(fleet, shapes[(model, batch)], DTYPE_BYTES, ps)
            r = row(size, model, batch, timed, even)
            rows.append(r)
            print(
                f"{size:>7} {model:<12} {batch:>5} {ps or 0:>8.2g} {r['plan_time_s']:>7.3f} {r['plan_cpu_s']:>6.3f} "
                f"{r['predicted_step_s']:>9.3f} {r['lower_bound_s']:>9.3f} {r['step_gap']:>6.2%} "
                f"{r['max_gemm_gap']:>8.2%} {r['devices_used']:>6} {r['even_split_ratio']:>9.2f}"
            )
    return rows


def summarize(rows: list[dict]) -> dict:
    """The headline figures of the largest fleet."""
    size = max(r["devices"] for r in rows)
    big = [r for r in rows if r["devices"] == size]
    return {
        "largest_fleet": size,
        "max_plan_time_s": max(r["plan_time_s"] for r in big),
        "max_plan_cpu_s": max(r["plan_cpu_s"] for r in big),
        "max_gemm_gap": max(r["max_gemm_gap"] for r in big),
        "even_split_ratio_min": min(r["even_split_ratio"] for r in big),
        "even_split_ratio_max": max(r["even_split_ratio"] for r in big),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10_000])
    ap.add_argument("--repeat", type=int, default=3, help="runs per plan; the fastest is reported")
    args = ap.parse_args()
    rows = measure(args.sizes, args.repeat)
    summary = summarize(rows)
    print(
        f"\n{summary['largest_fleet']} devices: whole-model plans in at most {summary['max_plan_time_s']:.3f} s "
        f"wall / {summary['max_plan_cpu_s']:.3f} s CPU, every GEMM within {summary['max_gemm_gap']:.2%} of its "
        f"lower bound, {summary['even_split_ratio_min']:.2f}-{summary['even_split_ratio_max']:.2f}x faster "
        "steps than the even split"
    )
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()}
    doc = {
        "benchmark": "planner",
        "fleet": "synthetic edge profile, seed 0",
        "seq": SEQ,
        "dtype_bytes": DTYPE_BYTES,
        "machine": machine,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "summary": summary,
        "rows": rows,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
