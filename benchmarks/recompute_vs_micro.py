"""Which way to fit a batch into the PS's memory costs less time per step: recomputing each block's forward in
the backward, or micro-batches? For GPT-2 Medium at 8 x 1024 (fp32 on the wire) on the synthetic edge fleet,
side by side: the preflight's peak estimate of each option and the cost-aware planner's predicted step
(`cleave plan`, the PS's egress at the simulator's default: what one PS process sends), against the same step
without either (which does not fit).
Writes benchmarks/results/recompute_vs_micro.json.

    nice -n 10 .venv/bin/python benchmarks/recompute_vs_micro.py [--devices 32,256,1024]
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

from cleave.sim.systems import DEFAULT_PS_BANDWIDTH
from cleave.train import preflight
from cleave.train.job import JobConfig
from cleave_cli.plan_cmd import plan_command

RESULTS = Path(__file__).parent / "results" / "recompute_vs_micro.json"
MODEL, BATCH, SEQ = "gpt2-medium", 8, 1024
OPTIONS = {  # name: the job's settings
    "neither": {},
    "recompute": {"recompute": True},
    "micro_batches=2": {"micro_batches": 2},
    "micro_batches=4": {"micro_batches": 4},
    "micro_batches=8": {"micro_batches": 8},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default="32,256,1024")
    args = p.parse_args()
    rows = []
    for name, fields in OPTIONS.items():
        job = JobConfig(**{"preset": MODEL, "batch_size": BATCH, "seq_len": SEQ, "recompute": False, **fields})
        est = preflight.estimate(job, workers=256)
        row = {"option": name, "ps_peak_gb": round(est.total / 1e9, 2), "head_chunks": est.layout.head_chunks}
        for n in args.devices.split(","):
            out = io.StringIO()
            plan_command(MODEL, f"synthetic:{n}", BATCH, SEQ, "fp32", DEFAULT_PS_BANDWIDTH, as_json=True,
                         assignments=False, out=out, layout=est.layout)
            row[f"step_s_{n}"] = round(json.loads(out.getvalue())["predicted_step_s"], 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for row in rows:  # each option's step against the step with neither
        for key in [k for k in row if k.startswith("step_s_")]:
            row[key.replace("step_s", "ratio")] = round(row[key] / rows[0][key], 3)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"model": MODEL, "batch": BATCH, "seq": SEQ, "ps_bandwidth": DEFAULT_PS_BANDWIDTH,
                                   "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
