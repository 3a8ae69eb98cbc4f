"""Emulated heterogeneous fleet: the planner's predicted step against the measured one, and the
cost-aware plan against the even split, side by side in one run.

Six workers on loopback declare different device profiles (`cleave worker --profile ...`) and pace
themselves to honour them; the scheduler plans the `small` preset's GEMMs for them (planner `cost`, then
`even`: every device, equal blocks). For each plan it reports the measured step against the scheduler's
prediction (`predicted_step_s`: the plan's GEMMs as the PS deals them, plus the PS's own work) and against
the simulator's (`cleave.sim.simulate_step` with the same profiles and the PS's measured own work), and the
GEMMs alone; and per GEMM kind, the median wall time against the plan's makespan (from the PS's debug log).
Writes benchmarks/results/emulated_fleet.json.

    .venv/bin/python benchmarks/emulated_fleet.py [--steps 6] [--preset small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from cleave.api.fleet import LocalFleet
from cleave.models import gemm_shapes
from cleave.plan.profile import parse_profile
from cleave.sim import simulate_step
from cleave.train.job import JobConfig

RESULTS = Path(__file__).parent / "results" / "emulated_fleet.json"
WARMUP_STEPS = 2
# slow enough that the declared devices, not this 2-core machine, set the pace
PROFILES = {
    "phone-a": "flops=0.4G,down=4M,up=1.5M,latency=0.03,memory=512Mi",
    "phone-b": "flops=0.6G,down=6M,up=2M,latency=0.02,memory=512Mi",
    "laptop-a": "flops=1.5G,down=12M,up=4M,latency=0.01,memory=1Gi",
    "laptop-b": "flops=2G,down=10M,up=5M,latency=0.01,memory=1Gi",
    "desktop": "flops=3G,down=16M,up=8M,latency=0.005,memory=2Gi",
    "straggler": "flops=0.1G,down=1M,up=0.5M,latency=0.05,memory=512Mi",
}


def gemm_table(log: Path) -> dict[str, dict]:
    """Per GEMM kind, from the PS's debug log: median wall time against the plan's makespan."""
    rows: dict[str, list[tuple[float, float]]] = {}
    for line in log.read_text().splitlines():
        if '"gemm_done"' in line:
            e = json.loads(line)
            if e["step"] >= WARMUP_STEPS:
                rows.setdefault(e["gemm"], []).append((e["wall_s"], e["planned_s"]))
    return {name: {"runs": len(v), "wall_s": statistics.median(w for w, _ in v),
                   "planned_s": statistics.median(p for _, p in v)} for name, v in rows.items()}


def run(planner: str, job: JobConfig, run_dir: Path) -> dict:
    fleet = LocalFleet(run_dir, 0, scheduler_env={"CLEAVE_SCHEDULER_PLANNER": planner})
    try:
        fleet.start()
        for name, spec in PROFILES.items():
            fleet.stack.service(name, "worker", ["--worker-id", name, "--profile", spec])
        fleet.start_ps(job, run_dir / "m.jsonl", ps_env={"CLEAVE_LOG_JSON": "1", "CLEAVE_LOG_LEVEL": "debug"})
        lines = fleet.wait_ps(run_dir / "m.jsonl", timeout_s=1800)
    finally:
        fleet.stop()
    body = [m for m in lines if m["step"] >= WARMUP_STEPS]

    def med(key: str) -> float | None:
        vals = [m[key] for m in body if m.get(key) is not None]
        return statistics.median(vals) if vals else None

    measured, predicted = med("step_time_s"), med("predicted_step_s")
    gemm, planned = med("gemm_s"), med("predicted_gemm_s")
    profiles = {name: parse_profile(spec) for name, spec in PROFILES.items()}
    shapes = gemm_shapes(job.arch(), job.batch_size, job.seq, job.layout())
    simulated = simulate_step(profiles, shapes, 4, planner=planner, steps=2)
    return {"planner": planner, "measured_step_s": measured, "predicted_step_s": predicted,
            "measured_over_predicted": measured / predicted if predicted else None,
            "measured_gemm_s": gemm, "predicted_gemm_s": planned,
            "gemm_measured_over_predicted": gemm / planned if planned else None,
            "simulated_gemm_s": simulated, "gemm_measured_over_simulated": gemm / simulated,
            "ps_own_s": measured - gemm, "gemms": gemm_table(run_dir / "logs" / "ps.log"),
            "losses": [m["loss"] for m in lines]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--preset", default="small")
    args = p.parse_args()
    job = JobConfig(job_id="emulated", preset=args.preset, steps=args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        cost = run("cost", job, Path(tmp) / "cost")
        even = run("even", job.model_copy(update={"job_id": "emulated-even"}), Path(tmp) / "even")
    out = {"preset": args.preset, "profiles": PROFILES, "cost": cost, "even": even,
           "even_over_cost_measured": even["measured_step_s"] / cost["measured_step_s"],
           "same_losses": all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(cost["losses"], even["losses"], strict=True))}
    nan = float("nan")
    for r in (cost, even):
        print(f"{r['planner']:>5}: measured {r['measured_step_s']:.2f}s/step, predicted "
              f"{r['predicted_step_s'] or nan:.2f}s -> measured/predicted {r['measured_over_predicted'] or nan:.2f} "
              f"(GEMMs {r['measured_gemm_s']:.2f}s vs planned {r['predicted_gemm_s'] or nan:.2f}s: "
              f"{r['gemm_measured_over_predicted'] or nan:.2f}, vs simulated {r['simulated_gemm_s']:.2f}s: "
              f"{r['gemm_measured_over_simulated']:.2f}; the PS's own work {r['ps_own_s']:.2f}s)")
    print("cost plan, per GEMM kind (median wall / planned makespan):")
    for name, g in sorted(cost["gemms"].items(), key=lambda kv: -kv[1]["wall_s"]):
        ratio = g["wall_s"] / g["planned_s"] if g["planned_s"] else nan
        print(f"  {name:<28} {g['wall_s']:7.3f}s {g['planned_s']:7.3f}s  x{ratio:.2f}")
    print(f"even split / cost-aware plan (measured): x{out['even_over_cost_measured']:.2f}; "
          f"losses identical under both plans: {out['same_losses']}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
