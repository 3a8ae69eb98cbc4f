"""Recovery benchmark: what losing a worker or the PS costs, against a stop-and-reload baseline.

One run, 4 workers on loopback, three jobs of the same preset:
  tile     a worker is SIGKILLed as its tiles of step K arrive; its tiles are re-sent within the step.
           Cost = that step's time minus the median step.
  ps       the PS is SIGKILLed in the middle of step K (state committed every step); the supervisor
           restarts it and it resumes. Cost = time from the kill to step K's completion, minus a median step.
  baseline what pipeline-style systems do on a failure: stop, restart from the last checkpoint (here every
           CHECKPOINT_EVERY steps), re-plan, redo the lost steps. Emulated with the same stack: the PS is
           killed in step K with checkpoints every CHECKPOINT_EVERY steps. Cost measured as for `ps`.
Prints the costs and the ratio baseline / tile. Writes benchmarks/results/recovery.json.

    .venv/bin/python benchmarks/recovery.py [--preset tiny] [--steps 14] [--kill-step 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from cleave.job import JobConfig
from cleave_cli.jobrun import LocalFleet

RESULTS = Path(__file__).parent / "results" / "recovery.json"
CHECKPOINT_EVERY = 5
WORKERS = 4


def run_job(job: JobConfig, run_dir: Path, ps_env: dict[str, str], victim_env: dict[str, str] | None) -> list[dict]:
    fleet = LocalFleet(run_dir, WORKERS - (1 if victim_env else 0))
    try:
        fleet.start()
        if victim_env:
            fleet.stack.service("victim", "worker", ["--worker-id", "victim"], env=victim_env, restart=False)
        fleet.start_ps(job, run_dir / "m.jsonl", ps_env=ps_env)
        return fleet.wait_ps(run_dir / "m.jsonl", timeout_s=900)
    finally:
        fleet.stop()


def kill_time(fault_dir: Path) -> float:
    return next(fault_dir.iterdir()).stat().st_mtime


def median_step(lines: list[dict], skip: set[int]) -> float:
    return statistics.median(m["step_time_s"] for m in lines if m["step"] not in skip and m["step"] >= 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--kill-step", type=int, default=8)
    args = p.parse_args()
    k = args.kill_step
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        job = JobConfig(job_id="rec-tile", preset=args.preset, steps=args.steps)
        lines = run_job(job, tmp / "tile", {}, {"CLEAVE_WORKER_FAIL_AT": f"tile:{k}",
                                                "CLEAVE_WORKER_FAULT_DIR": str(tmp / "tile-faults")})
        med = median_step(lines, {k})
        hit = next(m for m in lines if m["step"] == k)
        out["tile"] = {"median_step_s": med, "step_s": hit["step_time_s"], "cost_s": hit["step_time_s"] - med,
                       "recovery": hit["recovery"], "tiles_resent": hit["tiles_resent"]}
        for name, every in (("ps", 1), ("baseline", CHECKPOINT_EVERY)):
            fault_dir = tmp / f"{name}-faults"
            env = {"CLEAVE_PS_FAIL_AT": f"in_step:{k}", "CLEAVE_PS_FAULT_DIR": str(fault_dir),
                   "CLEAVE_PS_PERSIST_EVERY": str(every)}
            lines = run_job(JobConfig(job_id=f"rec-{name}", preset=args.preset, steps=args.steps), tmp / name, env, None)
            med = median_step(lines, {k})
            done = next(m for m in lines if m["step"] == k)["at"]
            cost = done - kill_time(fault_dir) - med
            out[name] = {"median_step_s": med, "kill_to_step_done_s": done - kill_time(fault_dir), "cost_s": cost,
                         "checkpoint_every": every, "redone_steps": k % every}
    out["baseline_over_tile"] = out["baseline"]["cost_s"] / max(out["tile"]["cost_s"], 1e-3)
    out["ps_over_tile"] = out["ps"]["cost_s"] / max(out["tile"]["cost_s"], 1e-3)
    print(f"worker lost mid-step: +{out['tile']['cost_s']:.2f}s on a {out['tile']['median_step_s']:.2f}s step "
          f"({out['tile']['tiles_resent']} tiles re-sent)")
    print(f"PS SIGKILL -> step done again: {out['ps']['kill_to_step_done_s']:.2f}s (cost {out['ps']['cost_s']:.2f}s)")
    print(f"baseline (restart from a checkpoint every {CHECKPOINT_EVERY} steps, redo {out['baseline']['redone_steps']}): "
          f"{out['baseline']['kill_to_step_done_s']:.2f}s (cost {out['baseline']['cost_s']:.2f}s)")
    print(f"baseline / tile-level recovery: x{out['baseline_over_tile']:.1f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
