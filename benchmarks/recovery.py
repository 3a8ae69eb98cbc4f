"""Recovery benchmark: what losing a worker costs Cleave, against what it costs a pipeline or data-parallel
system, side by side in one run (and, apart, what losing the PS costs).

One job on loopback (default `small`, 4 workers, the PS committing every CHECKPOINT_EVERY steps); a worker
is SIGKILLed as its tiles of step K arrive.
  tile      Cleave: its tiles are re-sent within the step. Cost = that step's time minus the median step.
  baseline  what pipeline- and data-parallel systems do when a device fails: the whole job stops, every
            process reloads the last checkpoint from JetStream, the fleet is re-planned, and the steps since
            the checkpoint are redone. Each part is measured in the same run, on the same stack:
              detect   the same failure detector Cleave uses (its recovery event's detect_s)
              reload   the job's last checkpoint read back from the stack's JetStream into a fresh model and
                       AdamW (one process loading the whole state: every stage loading its part from the same
                       server moves the same bytes)
              replan   from the kill to the scheduler's plan without the lost worker (event plan_changed)
              redo     k/2 steps at the run's median step: with a checkpoint every k steps and a failure at a
                       uniformly random time, the steps since the checkpoint plus the step in flight
            cost(k) = max(detect + reload, replan) + redo(k); process start-up is left out (it would only add
            to the baseline), so is stopping the job (taken as free).
  ps        (unless --skip-ps) the PS is SIGKILLed in step K with state committed every step; the supervisor
            restarts it. Cost = time from the kill to step K's completion, minus a median step.
Prints each cost and baseline/tile for k = 1, 5, 20. Writes benchmarks/results/recovery.json.

    nice -n 10 .venv/bin/python benchmarks/recovery.py [--preset small] [--steps 14] [--kill-step 8] [--skip-ps]
                                                       [--tile-timeout S] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from cleave import bus as busmod
from cleave import codec
from cleave.api.fleet import LocalFleet
from cleave.schemas import EVENTS_STREAM, Event, events_subject
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from cleave_ps.state.persist import Persister

RESULTS = Path(__file__).parent / "results" / "recovery.json"
CHECKPOINT_EVERY = 5  # the PS's commits in the run (the baseline's k only changes what is redone)
KS = (1, 5, 20)
WORKERS = 4


def kill_time(fault_dir: Path) -> float:
    return next(fault_dir.iterdir()).stat().st_mtime


def median_step(lines: list[dict], skip: set[int]) -> float:
    return statistics.median(m["step_time_s"] for m in lines if m["step"] not in skip and m["step"] >= 2)


async def last_event(bus: busmod.Bus, kind: str) -> Event:
    msg = await bus.js.get_last_msg(EVENTS_STREAM, events_subject(kind))
    return codec.decode(msg.data, Event)


async def after_the_job(url: str, job: JobConfig) -> dict:
    """On the run's stack, the job done: the re-plan event, and the checkpoint read back (timed)."""
    bus = await busmod.connect(url, "bench-recovery")
    try:
        plan = await last_event(bus, "plan_changed")
        trainer = await asyncio.to_thread(Trainer, job)
        persister = Persister(bus, job.job_id, job.model_dump_json())
        await persister.open()
        t0 = time.perf_counter()
        head = await persister.load(trainer.model, trainer.opt)
        reload_s = time.perf_counter() - t0
    finally:
        await bus.close()
    return {"plan_changed_at": plan.at, "plan_workers": plan.detail.get("workers"), "reload_s": reload_s,
            "checkpoint_step": head.step if head else None}


def tile_run(job: JobConfig, run_dir: Path, k: int, tile_timeout_s: float | None = None) -> dict:
    """The job with a worker that SIGKILLs itself at step k's tiles; what Cleave paid, and the baseline's parts."""
    fault_dir = run_dir / "faults"
    fleet = LocalFleet(run_dir, WORKERS - 1)
    try:
        fleet.start()
        fleet.stack.service("victim", "worker", ["--worker-id", "victim"], restart=False,
                            env={"CLEAVE_WORKER_FAIL_AT": f"tile:{k}", "CLEAVE_WORKER_FAULT_DIR": str(fault_dir)})
        env = {"CLEAVE_PS_PERSIST_EVERY": str(CHECKPOINT_EVERY)}
        if tile_timeout_s:
            env["CLEAVE_PS_TILE_TIMEOUT_S"] = str(tile_timeout_s)
        fleet.start_ps(job, run_dir / "m.jsonl", ps_env=env)
        lines = fleet.wait_ps(run_dir / "m.jsonl", timeout_s=1800)
        after = asyncio.run(after_the_job(fleet.stack.nats_url, job))
    finally:
        fleet.stop()
    killed = kill_time(fault_dir)
    med = median_step(lines, {k})
    hit = next(m for m in lines if m["step"] == k)
    detect = max((r["detect_s"] for r in hit["recovery"]), default=0.0)
    return {"median_step_s": med, "step_s": hit["step_time_s"], "cost_s": hit["step_time_s"] - med,
            "detect_s": detect, "tiles_resent": hit["tiles_resent"], "recovery": hit["recovery"],
            "replan_s": after["plan_changed_at"] - killed, "plan_workers_after": after["plan_workers"],
            "reload_s": after["reload_s"], "checkpoint_step": after["checkpoint_step"],
            "losses": [m["loss"] for m in lines]}


def baseline(t: dict, k: int) -> dict:
    redo = k / 2 * t["median_step_s"]
    cost = max(t["detect_s"] + t["reload_s"], t["replan_s"]) + redo
    return {"checkpoint_every": k, "detect_s": t["detect_s"], "reload_s": t["reload_s"], "replan_s": t["replan_s"],
            "redo_steps": k / 2, "redo_s": redo, "cost_s": cost, "over_tile": cost / max(t["cost_s"], 1e-3)}


def ps_run(job: JobConfig, run_dir: Path, k: int) -> dict:
    fault_dir = run_dir / "faults"
    env = {"CLEAVE_PS_FAIL_AT": f"in_step:{k}", "CLEAVE_PS_FAULT_DIR": str(fault_dir), "CLEAVE_PS_PERSIST_EVERY": "1"}
    fleet = LocalFleet(run_dir, WORKERS)
    try:
        fleet.start()
        fleet.start_ps(job, run_dir / "m.jsonl", ps_env=env)
        lines = fleet.wait_ps(run_dir / "m.jsonl", timeout_s=1800)
    finally:
        fleet.stop()
    med = median_step(lines, {k})
    done = next(m for m in lines if m["step"] == k)["at"]
    return {"median_step_s": med, "kill_to_step_done_s": done - kill_time(fault_dir),
            "cost_s": done - kill_time(fault_dir) - med, "checkpoint_every": 1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--kill-step", type=int, default=8)
    p.add_argument("--skip-ps", action="store_true", help="leave out the PS-kill run")
    p.add_argument("--tile-timeout", type=float, help="the PS's CLEAVE_PS_TILE_TIMEOUT_S (default: its own, 1 s)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    k, stamp = args.kill_step, time.time_ns()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tile = tile_run(JobConfig(job_id=f"rec-tile-{stamp}", preset=args.preset, steps=args.steps), tmp / "tile", k,
                        args.tile_timeout)
        out = {"preset": args.preset, "workers": WORKERS, "kill_step": k, "tile_timeout_s": args.tile_timeout, "tile": tile,
               "baseline": {str(every): baseline(tile, every) for every in KS}}
        if not args.skip_ps:
            out["ps"] = ps_run(JobConfig(job_id=f"rec-ps-{stamp}", preset=args.preset, steps=args.steps), tmp / "ps", k)
    print(f"{args.preset}, {WORKERS} workers: worker lost mid-step: Cleave +{tile['cost_s']:.2f}s on a "
          f"{tile['median_step_s']:.2f}s step ({tile['tiles_resent']} tiles re-sent, detected in {tile['detect_s']:.2f}s)")
    print(f"baseline parts: detect {tile['detect_s']:.2f}s, reload {tile['reload_s']:.2f}s, re-plan "
          f"{tile['replan_s']:.2f}s, redo k/2 x {tile['median_step_s']:.2f}s")
    for every, b in out["baseline"].items():
        print(f"  checkpoint every {every:>2}: baseline +{b['cost_s']:.2f}s -> baseline / Cleave x{b['over_tile']:.1f}")
    if "ps" in out:
        print(f"PS SIGKILL -> step done again: {out['ps']['kill_to_step_done_s']:.2f}s (cost {out['ps']['cost_s']:.2f}s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
