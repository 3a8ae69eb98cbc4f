"""Emulated heterogeneous fleet: the planner's predicted step against the measured one, and the
cost-aware plan against the even split, side by side in one run.

Six workers on loopback declare different device profiles (`cleave worker --profile ...`) and pace
themselves to honour them; the scheduler plans the `small` preset's GEMMs for them (planner `cost`, then
`even`: every device, equal blocks). Writes benchmarks/results/emulated_fleet.json.

    .venv/bin/python benchmarks/emulated_fleet.py [--steps 6] [--preset small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from cleave.job import JobConfig
from cleave_cli.jobrun import LocalFleet

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


def run(planner: str, job: JobConfig, run_dir: Path) -> dict:
    fleet = LocalFleet(run_dir, 0, scheduler_env={"CLEAVE_SCHEDULER_PLANNER": planner})
    try:
        fleet.start()
        for name, spec in PROFILES.items():
            fleet.stack.service(name, "worker", ["--worker-id", name, "--profile", spec])
        fleet.start_ps(job, run_dir / "m.jsonl")
        lines = fleet.wait_ps(run_dir / "m.jsonl", timeout_s=1800)
    finally:
        fleet.stop()
    body = [m for m in lines if m["step"] >= WARMUP_STEPS]
    measured = statistics.median(m["step_time_s"] for m in body)
    predicted = body[-1].get("predicted_step_s")
    return {"planner": planner, "measured_step_s": measured, "predicted_step_s": predicted,
            "measured_over_predicted": measured / predicted if predicted else None,
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
    for r in (cost, even):
        ratio = r["measured_over_predicted"]
        print(f"{r['planner']:>5}: measured {r['measured_step_s']:.2f}s/step, predicted "
              f"{r['predicted_step_s'] or float('nan'):.2f}s -> measured/predicted {ratio or float('nan'):.2f}")
    print(f"even split / cost-aware plan (measured): x{out['even_over_cost_measured']:.2f}; "
          f"losses identical under both plans: {out['same_losses']}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
