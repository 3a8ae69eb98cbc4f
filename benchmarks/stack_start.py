"""A local stack's services forked from a fork server against each started as a process of its own
(`CLEAVE_FORK_SERVER=0`), side by side: a stack of `--workers` workers starts, trains `--steps` `tiny` steps and
stops; the wall time of each part and the CPU the machine spent meanwhile (all its processes, from /proc/stat:
run it on a quiet machine; a forked service's CPU is its fork server's, which a program sees only once that
ends), alternated, `--rounds` of each. Forked twice:
from a new fork server (a program's first stack: `cleave train`, `cleave up`), and from the one the stack before
left (a program's later stacks: the Python API's runs, a test suite).

    .venv/bin/python benchmarks/stack_start.py [--workers 4] [--steps 2] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from cleave.api.fleet import LocalFleet
from cleave.api.forks import ENABLE_ENV, close_all
from cleave.train.job import JobConfig

MODES = {"forked, new server": "1", "forked, server reused": "1", "own processes": "0"}


def machine_cpu_s() -> float:
    """CPU seconds the machine has spent (user, nice and system, all CPUs) since it started."""
    user, nice, system = (int(x) for x in Path("/proc/stat").read_text().split()[1:4])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def one(workers: int, steps: int) -> dict:
    """Start a stack, train, stop: seconds of each, and the CPU seconds of its processes."""
    cpu0, t0 = machine_cpu_s(), time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        fleet = LocalFleet(Path(d) / "run", workers)
        try:
            fleet.start()
            t1 = time.monotonic()
            metrics = Path(d) / "metrics.jsonl"
            fleet.start_ps(JobConfig(job_id="bench", preset="tiny", steps=steps), metrics)
            fleet.wait_ps(metrics, timeout_s=600)
            t2 = time.monotonic()
        finally:
            fleet.stop()
    t3 = time.monotonic()
    return {"start_s": t1 - t0, "train_s": t2 - t1, "stop_s": t3 - t2, "total_s": t3 - t0,
            "cpu_s": machine_cpu_s() - cpu0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="write the figures here (JSON)")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode, flag in MODES.items():
            os.environ[ENABLE_ENV] = flag
            if mode == "forked, new server":
                close_all()
            got = one(args.workers, args.steps)
            runs[mode].append(got)
            print(f"round {r + 1} {mode:>21}: " + "  ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    median = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in runs.items()}
    ratio = {m: {k: median[m][k] / median["own processes"][k] for k in ("total_s", "cpu_s")}
             for m in MODES if m != "own processes"}
    for m, r in ratio.items():
        print(f"{m} / own processes (medians): total {r['total_s']:.2f}x, CPU {r['cpu_s']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"config": {"workers": args.workers, "steps": args.steps,
                                                   "rounds": args.rounds, "cpus": os.cpu_count()},
                                        "runs": runs, "median": median, "over_own_processes": ratio}, indent=1) + "\n")


if __name__ == "__main__":
    main()
