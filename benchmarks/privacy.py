"""Secure aggregation and client-level DP against plain FedAvg on the same job: loss, bytes and time.

One run per configuration on a real local stack (nats-server, scheduler, worker processes with the same ids,
so the same data shards), the same preset, seed, rounds and local steps:
- `fedavg`: plain FedAvg (the PS sees every update);
- `secagg`: the PS sees only the sum (keys, sealed shares, masked updates, reveals: `cleave.methods.secagg`);
- `clip`: every update clipped to `--clip` (what DP needs, without noise: its cost apart from the noise's);
- `dp-Z`: clipped, and Gaussian noise of Z x clip on each round's sum (`cleave.methods.privacy`), epsilon at 1e-5;
- `secagg+dp-Z`: both.
Reported per configuration: the validation loss after the last round, the median round wall time, bytes per
round at the PS (down: what it published; up: everything the workers sent it), and the epsilon spent.
Writes benchmarks/results/privacy.json.

    nice -n 10 .venv/bin/python benchmarks/privacy.py [--preset small] [--workers 3] [--rounds 10]
        [--local-steps 5] [--clip 1.0] [--noise 0.1 1.0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from cleave.train.job import JobConfig
from cleave_cli.jobrun import LocalFleet

RESULTS = Path(__file__).parent / "results" / "privacy.json"
JOB_TIMEOUT_S = 3600


def configs(clip: float, noise: list[float]) -> dict[str, dict]:
    out = {"fedavg": {}, "secagg": {"secagg": True}, "clip": {"update_clip": clip}}
    for z in noise:
        out[f"dp-{z:g}"] = {"update_clip": clip, "dp_noise": z}
        out[f"secagg+dp-{z:g}"] = {"secagg": True, "update_clip": clip, "dp_noise": z}
    return out


def run(run_dir: Path, job: JobConfig, workers: int) -> list[dict]:
    fleet = LocalFleet(run_dir, workers)
    try:
        fleet.start()
        fleet.start_ps(job, run_dir / "m.jsonl")
        return fleet.wait_ps(run_dir / "m.jsonl", timeout_s=JOB_TIMEOUT_S)
    finally:
        fleet.stop()


def summary(lines: list[dict]) -> dict:
    return {
        "rounds": len(lines),
        "val_loss": lines[-1]["val_loss"],
        "first_loss": lines[0]["loss"],
        "median_round_s": statistics.median(m["step_time_s"] for m in lines),
        "bytes_down_ps": statistics.fmean(m["bytes_down"] for m in lines),
        "bytes_up_ps": statistics.fmean(m["bytes_up"] for m in lines),
        "epsilon": lines[-1].get("dp_epsilon"),
        "workers": [m["workers"] for m in lines],
    }


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["config"] == "fedavg"), results[0])
    rows = [f"{'config':<16} {'val loss':>8} {'vs fedavg':>9} {'round s':>8} {'down KB':>9} {'up KB':>9} "
            f"{'up x':>5} {'epsilon':>8}"]
    for r in results:
        eps = "" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
        rows.append(f"{r['config']:<16} {r['val_loss']:>8.4f} {r['val_loss'] - base['val_loss']:>+9.4f} "
                    f"{r['median_round_s']:>8.2f} {r['bytes_down_ps'] / 1e3:>9.1f} {r['bytes_up_ps'] / 1e3:>9.1f} "
                    f"{r['bytes_up_ps'] / base['bytes_up_ps']:>5.2f} {eps:>8}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--noise", type=float, nargs="*", default=[0.1, 1.0])
    ap.add_argument("--only", nargs="*", help="run only these configurations")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="cleave-privacy-") as tmp:
        for name, extra in configs(args.clip, args.noise).items():
            if args.only and name not in args.only:
                continue
            job = JobConfig(job_id=f"{name.replace('+', '-').replace('.', '_')}-{time.time_ns()}", preset=args.preset, method="fedavg",
                            steps=args.rounds, local_steps=args.local_steps, val_every=args.rounds, **extra)
            lines = run(Path(tmp) / name / "run", job, args.workers)  # same worker ids in every run
            results.append({"config": name, **summary(lines)})
            print(table(results).splitlines()[-1], flush=True)
    print(f"{args.preset}, {args.workers} workers, {args.rounds} rounds, E={args.local_steps}, clip {args.clip}")
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"preset": args.preset, "workers": args.workers, "rounds": args.rounds,
                                    "local_steps": args.local_steps, "clip": args.clip, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
