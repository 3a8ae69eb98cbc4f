"""The simulator's default point (OPT-13B, 256 devices, batch 128 x 1,024, fp16) three ways, side by side in
one run: an unlimited PS without fan-out (the published setting), an unlimited PS with fan-out, and the
default PS (what one PS process sends, measured) with fan-out; each with the PS's own bill (`cleave.sim.ps`):
its work, its memory, what bounds one PS, and the data-parallel PS replicas the job needs. Writes
benchmarks/results/sim_default_point.json (docs/evaluation.md cites it).

    .venv/bin/python benchmarks/sim_default_point.py
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from cleave.sim.systems import DEFAULT_PS_BANDWIDTH, SimConfig, compare

OUT = Path(__file__).parent / "results" / "sim_default_point.json"
CASES = (  # (case, PS link bytes/s or None, fan-out, the command that gives the same point)
    ("unlimited, no fan-out", None, False, "--ps-bandwidth 0 --no-fanout"),
    ("unlimited, fan-out", None, True, "--ps-bandwidth 0"),
    ("default PS, fan-out", DEFAULT_PS_BANDWIDTH, True, f"--ps-bandwidth {DEFAULT_PS_BANDWIDTH}"),
)


def row(case: str, bandwidth: float | None, fan_out: bool, flags: str) -> dict:
    cfg = replace(SimConfig(), ps_bandwidth=bandwidth, fan_out=fan_out, systems=("cleave",))
    me = compare(cfg)["systems"]["cleave"]
    ps = me["ps"]
    return {
        "case": case, "ps_bandwidth": bandwidth, "fan_out": fan_out,
        "step_s": me["step_s"], "gemm_step_s": me["gemm_step_s"], "predicted_step_s": me["predicted_step_s"],
        "ps_bytes_per_step": me["ps_bytes_per_step"], "distinct_input_bytes": me["distinct_input_bytes"],
        "tiles_resent": me["tiles_resent"], "copied": me["copied"],
        "recovery_s": me["recovery_s"], "recovery_worst_s": me["recovery"]["worst_s"],
        "per_device_down_bytes": me["per_device_down_bytes"],
        "ps_compute_s": ps["compute_s"], "ps_flops": ps["flops"]["total"], "ps_attention_flops": ps["flops"]["attention"],
        "ps_memory_bytes": ps["memory_bytes"], "ps_egress_s": ps["egress_s"], "fleet_s": ps["fleet_s"],
        "ps_bound": ps["bound"], "ps_time_bound": ps["time_bound"],
        "ps_replicas_by_memory": ps["replicas_by_memory"], "ps_replicas": ps["replicas"],
        "with_replicas": ps["with_replicas"], "by_replicas": ps["by_replicas"],
        "command": f"cleave sim --model opt-13b --devices 256 --systems cleave {flags} --json",
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()  # (--help)
    rows = [row(*c) for c in CASES]
    for r in rows:
        best = r["with_replicas"] or {}
        print(f"{r['case']:22s} step {r['step_s']:9.1f} s (GEMMs {r['gemm_step_s']:9.1f} s, PS own work "
              f"{r['ps_compute_s']:5.1f} s); one PS bound by {r['ps_bound']} ({r['ps_time_bound']} in time); "
              f"{r['ps_replicas']} replicas: {best.get('step_s', float('nan')):8.1f} s")
    OUT.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
