"""What closes the gap to the pipeline at the simulator's default point (OPT-13B, 256 devices, 512 MiB,
batch 128 x 1,024, fp16): every lever of `cleave.sim.levers.LEVERS` simulated side by side in one run, with
an unlimited PS link (the published setting) and the default one (what one PS process sends, measured), each
with its step's breakdown (`cleave.sim.breakdown`), against the best baseline (the pipeline with memory
ignored, the same fleet).
Writes benchmarks/results/sim_levers.json (docs/evaluation.md, "What closes the gap to the pipeline").

    nice -n 10 .venv/bin/python benchmarks/sim_levers.py            # the default point (about 15 minutes, shared 2 cores)
    nice -n 10 .venv/bin/python benchmarks/sim_levers.py --model opt-1.3b --devices 64 --batch 16 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from cleave.sim.levers import LEVERS, run_lever
from cleave.sim.systems import DEFAULT_PS_BANDWIDTH, SimConfig, compare

OUT = Path(__file__).parent / "results" / "sim_levers.json"


def line(r: dict, base: dict, pipeline_s: float) -> str:
    b = r["breakdown"]
    bound = b["devices_bound_by"]
    return (f"{r['lever']:24s} step {r['step_s']:8.1f} s  x{r['step_s'] / base['step_s']:5.2f} of default  "
            f"x{r['step_s'] / pipeline_s:5.2f} of pipeline  PS sent {b['ps_bytes'] / 1e12:5.2f} TB "
            f"({b['ps_bytes'] / b['distinct_input_bytes']:4.2f}x distinct)  devices bound by down/compute/up "
            f"{bound['down']}/{bound['compute']}/{bound['up']}  idle {b['device_idle_share']:.2f}  "
            f"planner's bound {b['lower_bound_s']:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-13b")
    ap.add_argument("--devices", type=int, default=256)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--levers", default="", help="comma-separated lever names (default: all)")
    ap.add_argument("--links", default="unlimited,ps", help="PS links to run, in order: unlimited, ps (the default)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    cfg = replace(SimConfig(), model=args.model, devices=args.devices, batch=args.batch)
    wanted = {s.strip() for s in args.levers.split(",") if s.strip()}
    levers = [lv for lv in LEVERS if not wanted or lv.name in wanted]
    pipe = compare(replace(cfg, systems=("pipeline",)))["systems"]["pipeline"]
    pipeline_s = pipe["unconstrained_step_s"] or pipe["step_s"]
    rows = []
    links = {"unlimited": None, "ps": DEFAULT_PS_BANDWIDTH}
    for label in args.links.split(","):
        bw = links[label]
        print(f"PS link {label}; the pipeline (memory ignored) {pipeline_s:.1f} s")
        base = None
        for lv in levers:
            r = {"ps_link": label, **run_lever(replace(cfg, ps_bandwidth=bw), lv)}
            base = base or r
            r["vs_default"] = r["step_s"] / base["step_s"]
            r["vs_pipeline"] = r["step_s"] / pipeline_s
            print(line(r, base, pipeline_s), flush=True)
            rows.append(r)
            args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                            "pipeline_unconstrained_step_s": pipeline_s,
                                            "pipeline_feasible": pipe["feasible"], "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
