"""Kernel-shaped links: the scheduler's predicted GEMM times against the measured ones, and the cost-aware
plan against the even split, side by side in one run.

Six workers, each in its own network namespace behind a veth pair shaped by tbf (`cleave.runtime.netlab`) to a
different downlink/uplink, measure their own profiles (probes, FLOPS) as real devices do, and the
scheduler plans the `small` preset's GEMMs for them (planner `cost`, then `even`). Nothing paces itself
to the cost model: the links are the kernel's. For each plan it reports, after the warm-up steps, the
measured GEMM time per step against the plan's (`gemm_s` vs `predicted_gemm_s`), and per GEMM kind the
median wall time against the plan's makespan (from the PS's debug log), and the simulator's step
(`cleave.sim.simulate_step`) on the last profiles the workers measured (a re-probe during training
measures less than the first; the plans were made with the profiles of their time). The six workers share
this machine's cores; with `--cpu-shares` each runs in a CPU share of its own (`Link.cpu`, a CFS quota;
1.5 cores in all), so that they do not take each other's compute. The model predicts a step's GEMMs one after
the other, so the PS deals them so in these two runs (`deferred_gemms: 0`); a third run of the cost plan with
the PS's default (weight gradients dealt beside the backward, docs/architecture.md) measures what that
overlap gains behind these links. With `--chunks 1 4` it instead runs the cost plan as `cleave train` does
(weight gradients dealt beside the backward) once with each number of pieces a planned block goes out in
(the scheduler's `chunks`), alternated `--rounds` times: whether streaming a block in pieces pays behind
these links. Needs root.
Writes benchmarks/results/real_links.json (`--out` elsewhere).

    sudo nice -n 10 .venv/bin/python benchmarks/real_links.py [--steps 8] [--preset small] [--cpu-shares] [--no-deferred]
                                                            [--chunks 1 4 [--rounds 2]]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from cleave.gemm.ledger import DEFAULT_DEFERRED
from cleave.models import gemm_shapes
from cleave.runtime import netlab
from cleave.runtime.netlab import Link
from cleave.schemas import DeviceProfile
from cleave.sim import simulate_step
from cleave.train.job import JobConfig
from cleave_cli.netstack import ShapedFleet

RESULTS = Path(__file__).parent / "results" / "real_links.json"
WARMUP_STEPS = 2
MB = 1e6
LINKS = [  # down, up in bytes/s: the literature's edge profile (downlink 2-10x the uplink), scaled down;
    # cores (with --cpu-shares): phones and the straggler 0.15-0.2, laptops 0.3, the desktop 0.4
    Link("phone-a", down=4 * MB, up=1.5 * MB, cpu=0.15),
    Link("phone-b", down=6 * MB, up=2 * MB, cpu=0.2),
    Link("laptop-a", down=12 * MB, up=4 * MB, cpu=0.3),
    Link("laptop-b", down=10 * MB, up=5 * MB, cpu=0.3),
    Link("desktop", down=16 * MB, up=8 * MB, cpu=0.4),
    Link("straggler", down=1 * MB, up=0.5 * MB, cpu=0.15),
]


def gemm_table(log: Path) -> dict[str, dict]:
    """Per GEMM kind, from the PS's debug log: median wall time against the plan's makespan."""
    rows: dict[str, list[tuple[float, float]]] = {}
    for line in log.read_text().splitlines():
        if '"gemm_done"' in line:
            e = json.loads(line)
            if e["step"] >= WARMUP_STEPS:
                rows.setdefault(e["gemm"], []).append((e["wall_s"], e["planned_s"]))
    return {name: {"runs": len(v), "wall_s": statistics.median(w for w, _ in v),
                   "planned_s": statistics.median(p for _, p in v),
                   "measured_over_planned": statistics.median(w for w, _ in v) / max(statistics.median(p for _, p in v), 1e-9)}
            for name, v in rows.items()}


def spread(gemms: dict[str, dict]) -> dict[str, float]:
    """Per GEMM kind, measured / planned: the smallest, the median, the largest, and how many kinds are
    within 20%."""
    r = sorted(g["measured_over_planned"] for g in gemms.values())
    return {"min": r[0], "median": statistics.median(r), "max": r[-1], "kinds": len(r),
            "within_20pct": sum(0.8 <= x <= 1.2 for x in r)} if r else {}


def profiles(run_dir: Path, links: list[Link]) -> dict[str, dict]:
    """What each worker measured (its last links_measured line)."""
    out = {}
    for link in links:
        for line in (run_dir / "logs" / f"worker-{link.id}.log").read_text().splitlines():
            if '"links_measured"' in line:
                e = json.loads(line)
                out[link.id] = {"down": e["down"], "up": e["up"], "latency_s": e["latency_s"], "flops": e["flops"],
                                "bounded": e["bounded"], "shaped_down": link.down, "shaped_up": link.up,
                                "cpu_cores": link.cpu}
    return out


def run(planner: str, job: JobConfig, run_dir: Path, links: list[Link], deferred: int = 0,
        chunks: int | None = None) -> dict:
    env = {"CLEAVE_LOG_JSON": "1"}
    fleet = ShapedFleet(run_dir, 0, links=links, worker_env=env,
                        scheduler_env={**env, "CLEAVE_SCHEDULER_PLANNER": planner,
                                       **({"CLEAVE_SCHEDULER_CHUNKS": str(chunks)} if chunks else {})})
    with fleet:
        fleet.start_ps(job, run_dir / "m.jsonl", ps_env={**env, "CLEAVE_LOG_LEVEL": "debug",
                                                           "CLEAVE_PS_DEFERRED_GEMMS": str(deferred)})
        lines = fleet.wait_ps(run_dir / "m.jsonl", timeout_s=1800)
    body = [m for m in lines if m["step"] >= WARMUP_STEPS]
    steps = [{"step": m["step"], "gemm_s": m["gemm_s"], "predicted_gemm_s": m["predicted_gemm_s"],
              "ratio": m["gemm_s"] / m["predicted_gemm_s"] if m["predicted_gemm_s"] else None,
              "step_time_s": m["step_time_s"], "workers": m["workers"]} for m in body]
    gemm = statistics.median(m["gemm_s"] for m in body)
    planned = [m["predicted_gemm_s"] for m in body if m["predicted_gemm_s"]]
    predicted = statistics.median(planned) if planned else None
    measured = profiles(run_dir, links)
    fleet_profiles = {w: DeviceProfile(flops=p["flops"], memory_bytes=512 * 1024**2, downlink_bytes_per_s=p["down"],
                                       uplink_bytes_per_s=p["up"], latency_s=p["latency_s"]) for w, p in measured.items()}
    shapes = gemm_shapes(job.arch(), job.batch_size, job.seq, job.layout())
    simulated = simulate_step(fleet_profiles, shapes, 4, planner=planner, steps=2)  # the same measured profiles
    gemms = gemm_table(run_dir / "logs" / "ps.log")
    return {"planner": planner, "deferred_gemms": deferred, "chunks": chunks, "measured_gemm_s": gemm,
            "predicted_gemm_s": predicted,
            "gemm_measured_over_predicted": gemm / predicted if predicted else None,
            "simulated_gemm_s": simulated, "gemm_measured_over_simulated": gemm / simulated,
            "measured_step_s": statistics.median(m["step_time_s"] for m in body), "steps": steps,
            "gemms": gemms, "per_kind": spread(gemms), "profiles": measured,
            "losses": [m["loss"] for m in lines]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--preset", default="small")
    p.add_argument("--cpu-shares", action="store_true", help="a CPU share per device (Link.cpu; needs cgroup v1)")
    p.add_argument("--no-deferred", dest="deferred", action="store_false",
                   help="skip the third run (the cost plan with weight gradients dealt beside the backward)")
    p.add_argument("--chunks", nargs="+", type=int, default=None,
                   help="compare these numbers of pieces a block (the cost plan, dW deferred) instead")
    p.add_argument("--rounds", type=int, default=2, help="with --chunks: alternated rounds")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    why = netlab.unavailable() or (netlab.cpu_unavailable() if args.cpu_shares else None)
    if why:
        sys.exit(f"real_links needs network namespaces (and with --cpu-shares, cgroups): {why}")
    links = LINKS if args.cpu_shares else [replace(link, cpu=None) for link in LINKS]
    job = JobConfig(job_id="real-links", preset=args.preset, steps=args.steps)
    if args.chunks:
        return compare_chunks(job, links, args.chunks, args.rounds, args.out, args.cpu_shares)
    with tempfile.TemporaryDirectory() as tmp:
        cost = run("cost", job, Path(tmp) / "cost", links)
        even = run("even", job.model_copy(update={"job_id": "real-links-even"}), Path(tmp) / "even", links)
        overlap = run("cost", job.model_copy(update={"job_id": "real-links-deferred"}), Path(tmp) / "deferred", links,
                      DEFAULT_DEFERRED) if args.deferred else None
    out = {"preset": args.preset, "steps": args.steps, "cpu_shares": args.cpu_shares,
           "links": [link.__dict__ for link in links], "cost": cost, "even": even,
           "even_over_cost_measured": even["measured_gemm_s"] / cost["measured_gemm_s"], "deferred": overlap,
           "same_losses": all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(cost["losses"], even["losses"], strict=True))}
    nan = float("nan")
    for r in (cost, even):
        print(f"{r['planner']:>5}: GEMMs {r['measured_gemm_s']:.2f}s/step measured vs {r['predicted_gemm_s'] or nan:.2f}s "
              f"predicted -> x{r['gemm_measured_over_predicted'] or nan:.2f}; simulated {r['simulated_gemm_s']:.2f}s -> "
              f"x{r['gemm_measured_over_simulated']:.2f} (step {r['measured_step_s']:.2f}s); per kind "
              f"x{r['per_kind']['min']:.2f}-{r['per_kind']['max']:.2f}, median {r['per_kind']['median']:.2f}, "
              f"{r['per_kind']['within_20pct']} of {r['per_kind']['kinds']} within 20%")
        for name, g in sorted(r["gemms"].items(), key=lambda kv: -kv[1]["wall_s"]):
            print(f"    {name:<28} {g['wall_s']:7.3f}s {g['planned_s']:7.3f}s  x{g['measured_over_planned']:.2f}")
    print("measured profiles (cost run): " + ", ".join(
        f"{w} {p['down'] / MB:.1f}/{p['up'] / MB:.1f} MB/s (shaped {p['shaped_down'] / MB:.1f}/{p['shaped_up'] / MB:.1f}), {p['flops'] / 1e9:.0f} GFLOP/s"
        for w, p in cost["profiles"].items()))
    print(f"even split / cost-aware plan (measured GEMM time): x{out['even_over_cost_measured']:.2f}; "
          f"losses identical under both plans: {out['same_losses']}")
    if overlap:
        print(f"cost plan, weight gradients dealt beside the backward (deferred_gemms {DEFAULT_DEFERRED}): step "
              f"{overlap['measured_step_s']:.2f}s vs {cost['measured_step_s']:.2f}s one GEMM at a time "
              f"(x{overlap['measured_step_s'] / cost['measured_step_s']:.2f}); GEMM time {overlap['measured_gemm_s']:.2f}s "
              f"vs {cost['measured_gemm_s']:.2f}s; losses identical: {overlap['losses'] == cost['losses']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


def compare_chunks(job: JobConfig, links: list[Link], chunks: list[int], rounds: int, out: Path, cpu_shares: bool) -> None:
    """The cost plan with each number of pieces a block, alternated: step and GEMM time, same losses."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for c in chunks:
                j = job.model_copy(update={"job_id": f"real-links-c{c}-{r}"})
                runs.append(run("cost", j, Path(tmp) / f"c{c}-{r}", links, DEFAULT_DEFERRED, c))
                m = runs[-1]
                print(f"round {r} chunks {c}: step {m['measured_step_s']:.2f}s, GEMMs {m['measured_gemm_s']:.2f}s "
                      f"(predicted {m['predicted_gemm_s'] or float('nan'):.2f}s)", flush=True)
    by = {c: [m for m in runs if m["chunks"] == c] for c in chunks}
    summary = {str(c): {"step_s": [m["measured_step_s"] for m in ms], "gemm_s": [m["measured_gemm_s"] for m in ms],
                        "predicted_gemm_s": [m["predicted_gemm_s"] for m in ms]} for c, ms in by.items()}
    for c, s in summary.items():
        print(f"chunks {c}: step {', '.join(f'{x:.2f}' for x in s['step_s'])} s; GEMMs "
              f"{', '.join(f'{x:.2f}' for x in s['gemm_s'])} s (predicted {', '.join(f'{x or 0:.2f}' for x in s['predicted_gemm_s'])})")
    # other pieces are products of other shapes, which BLAS may round differently in a float's last bit
    same = all(m["losses"] == ms[0]["losses"] for ms in by.values() for m in ms)
    diff = max(abs(a - b) / abs(b) for m in runs for a, b in zip(m["losses"], runs[0]["losses"], strict=True))
    print(f"losses identical between runs with the same pieces: {same}; largest relative difference {diff:.1e}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": job.preset, "steps": job.steps, "cpu_shares": cpu_shares,
                               "links": [link.__dict__ for link in links], "chunks": summary,
                               "same_losses_per_chunks": same, "max_rel_loss_diff": diff, "runs": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
