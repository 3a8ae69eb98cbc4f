"""The planner against the exact optimum of the published MILP (one block per device, solved by HiGHS through
`scipy.optimize.milp`), on the random instances of tests/unit/test_planner.py: up to 16 devices, small shapes,
tight memories. Prints each instance and writes benchmarks/results/planner_milp.json.

The MILP gives each device one block; the planner may give a device several blocks in turn, each within its
memory. Where it does, it can finish below the MILP's optimum, which is then no bound on it: the rows say how
many blocks the busiest device got.

    .venv/bin/python benchmarks/planner_milp.py [--seeds 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cleave.plan.planner import plan_gemm  # noqa: E402
from tests.unit.test_planner import area_milp_optimum, milp_instance  # noqa: E402 - the tests' MILP and instances

OUT = Path(__file__).resolve().parent / "results" / "planner_milp.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=40, help="instances 0 .. SEEDS-1")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    rows = []
    print(f"{'seed':>4} {'devices':>7} {'m x n':>7} {'planner/MILP - 1':>16} {'most blocks on a device':>23}")
    for seed in range(args.seeds):
        fleet, m, n, k = milp_instance(seed)
        opt = area_milp_optimum(fleet, m, n, k, 2)
        plan = plan_gemm(fleet, m, n, k, 2)
        most = int(np.bincount(plan.dev).max())
        rows.append({"seed": seed, "devices": len(fleet), "m": m, "n": n, "k": k, "milp_s": opt,
                     "planner_s": plan.makespan_s, "gap": plan.makespan_s / opt - 1,
                     "planner_bound_s": plan.lower_bound_s, "most_blocks_on_a_device": most})
        print(f"{seed:>4} {len(fleet):>7} {f'{m}x{n}':>7} {rows[-1]['gap']:>+16.4f} {most:>23}")
    one = [r for r in rows if r["most_blocks_on_a_device"] == 1]
    below = [r for r in rows if r["gap"] < -1e-6]
    summary = {"instances": len(rows), "worst_gap": max(r["gap"] for r in rows),
               "worst_gap_one_block_each": max(r["gap"] for r in one) if one else None,
               "below_milp": len(below), "lowest_gap": min(r["gap"] for r in rows),
               "below_milp_with_several_blocks_on_a_device": sum(r["most_blocks_on_a_device"] > 1 for r in below),
               # where each device got one block, the planner's own lower bound against the MILP's optimum
               "one_block_each": len(one),
               "bound_equal_to_milp": sum(r["planner_bound_s"] >= r["milp_s"] * (1 - 1e-6) for r in one),
               "lowest_bound_over_milp": min((r["planner_bound_s"] / r["milp_s"] for r in one), default=None)}
    print(f"worst: planner {summary['worst_gap']:+.2%} over the MILP; {summary['below_milp']} of {len(rows)} "
          f"below it (down to {summary['lowest_gap']:+.2%}), every one with a device given several blocks: "
          f"{summary['below_milp_with_several_blocks_on_a_device'] == len(below)}")
    doc = {"benchmark": "planner_milp", "machine": {"python": platform.python_version()},
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "summary": summary, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
