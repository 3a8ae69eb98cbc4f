"""Fleet-scale benchmark: the PS, the scheduler and re-planning with 10, 100, 1,000 real workers (`cleave swarm`).

For each size W, on one machine: nats-server and the scheduler (the local stack), W workers in 10 `cleave swarm`
processes (each holds 10% of the swarm), then a PS training a tiny-shaped job. Measured side by side:
  ps_cpu_s_per_tile    the PS process's CPU seconds (/proc) from the end of step 0 to the end of the last step,
                       over the tiles of those steps (its per-step commit of the tiny model included)
  gemm_tail_s          the slowest GEMM tail: the last result of a GEMM arriving on the bus (this process
                       listens on the result subject too) -> the PS's `gemm_done` (debug log, JSON)
  scheduler_cpu_s_per_heartbeat  the scheduler's CPU over a quiet window before the job, over the heartbeats
                       sent in it (counted on the bus)
  replan_s             one swarm process (10%) is SIGKILLed after step `--kill-after`; seconds until the PS logs
                       `plan_applied` for the smaller fleet. It includes the scheduler's detection (detect_s:
                       the kill -> its last `worker_lost`, about liveness_s); replan_after_detect_s is the rest,
                       and plan_s the planner's part of that (the scheduler's `plan_published`)
  steps_ok             steps whose loss equals the single-process reference (rtol 1e-4), of `steps`
A size that does not finish within `--time-limit-s` reports what it reached (`status: time_limit`, `gemms_done`,
`gemm_wall_s_median`, and `ps_cpu_s_per_tile_upper`: the PS's CPU since its start over the tiles of its done GEMMs).
The swarm processes run at `nice 10` (they stand in for other machines). Ratios against the smallest size are printed; rows go to benchmarks/results/fleet_scale.json.

    nice -n 10 .venv/bin/python benchmarks/fleet_scale.py --workers 10,100,1000 [--steps 6] [--time-limit-s 600]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import floors

from cleave import bus as busmod
from cleave import codec
from cleave.api.fleet import LocalFleet, MetricsTail, run_reference
from cleave.errors import WireError
from cleave.schemas import MAX_PLAN_BYTES, PLAN_BUCKET, PLAN_KEY, Plan, TileResult
from cleave.train.job import JobConfig

RESULTS = Path(__file__).parent / "results" / "fleet_scale.json"
PROCESSES = 10  # swarm processes per size: killing one is 10% of the swarm leaving
POLL_S = 0.1
# The swarm stands in for devices elsewhere: on this machine it must not starve the PS, the scheduler and
# nats-server of the CPU they would have to themselves (their figures are what is measured).
SWARM_NICE = 10


def log_events(path: Path, event: str) -> list[dict]:
    """The JSON log lines of `event` in a service's log (other lines are skipped)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if f'"{event}"' not in line:
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if doc.get("event") == event:
            doc["at"] = datetime.fromisoformat(doc["timestamp"]).timestamp()
            out.append(doc)
    return out


async def wait_plan(bus: busmod.Bus, workers: int, deadline: float) -> Plan:
    kv = await bus.kv(PLAN_BUCKET)
    while time.monotonic() < deadline:
        got = await bus.kv_get(kv, PLAN_KEY, Plan, MAX_PLAN_BYTES)
        if got and len(got[0].workers) >= workers:
            return got[0]
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no plan with {workers} workers in time")


class BusWatch:
    """Counts heartbeats and records when each GEMM's results arrive, listening on the bus like the PS."""

    def __init__(self) -> None:
        self.heartbeats = 0
        self.last_result: dict[tuple[int, int], float] = {}

    async def start(self, bus: busmod.Bus, job_id: str) -> None:
        async def on_hb(msg) -> None:
            self.heartbeats += 1

        async def on_result(msg) -> None:
            try:
                r = codec.decode(msg.data, TileResult)
            except WireError:
                return
            self.last_result[(r.step, r.op)] = time.time()

        self.subs = [await bus.nc.subscribe("cleave.hb.*", cb=on_hb),
                     await bus.nc.subscribe(f"cleave.result.{job_id}.>", cb=on_result)]


def gemm_tails(ps_log: Path, last_result: dict[tuple[int, int], float]) -> list[float]:
    """Per GEMM: its `gemm_done` minus its last result's arrival (the i-th GEMM of a step is op i)."""
    seen: dict[int, int] = {}
    tails = []
    for e in log_events(ps_log, "gemm_done"):
        op = seen[e["step"]] = seen.get(e["step"], 0) + 1
        if (e["step"], op) in last_result:
            tails.append(e["at"] - last_result[(e["step"], op)])
    return tails


def gemm_figures(row: dict, ps_log: Path, last_result: dict[tuple[int, int], float]) -> None:
    """The slowest tail, and what the GEMMs reached (for a size stopped by the time limit, the only figures)."""
    row["gemm_tail_s"] = max(gemm_tails(ps_log, last_result), default=None)
    done = log_events(ps_log, "gemm_done")
    row["gemms_done"] = len(done)
    row["gemm_wall_s_median"] = statistics.median(e["wall_s"] for e in done) if done else None
    tiles = sum(e["tiles"] for e in done)
    if "ps_cpu_s_at_limit" in row and tiles:  # an upper bound: the PS's start-up is in it
        row["ps_cpu_s_per_tile_upper"] = row["ps_cpu_s_at_limit"] / tiles


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


async def run_size(w: int, args: argparse.Namespace, tmp: Path) -> dict:
    t0, deadline = time.monotonic(), time.monotonic() + args.time_limit_s
    row: dict = {"workers": w, "processes": min(PROCESSES, w), "status": "ok", "steps": args.steps, "steps_ok": 0,
                 "ps_cpu_s_per_tile": None, "gemm_tail_s": None, "replan_s": None,
                 "scheduler_cpu_s_per_heartbeat": None, "liveness_s": args.liveness_s}
    run_dir = tmp / f"w{w}"
    fleet = LocalFleet(run_dir, 0, scheduler_env={"CLEAVE_SCHEDULER_LIVENESS_S": str(args.liveness_s),
                                                  "CLEAVE_LOG_JSON": "1"})
    job = JobConfig(preset=args.preset, steps=args.steps, job_id=f"fleet-{w}")
    watch, metrics, bus = BusWatch(), run_dir / "metrics.jsonl", None
    try:
        fleet.start()
        bus = await busmod.connect(fleet.stack.nats_url, "cleave-bench")
        await bus.setup()
        await watch.start(bus, job.job_id)
        counts = split(w, row["processes"])
        for p, n in enumerate(counts):
            fleet.stack.spawn(f"swarm-{p}", "worker", [
                "nice", "-n", str(SWARM_NICE), sys.executable, "-m", "cleave_cli", "swarm", "--workers", str(n), "--process-index", str(p),
                "--nats", fleet.stack.nats_url, "--heartbeat-s", str(args.heartbeat_s)], restart=False)
        await wait_plan(bus, w, deadline)
        row["join_s"] = round(time.monotonic() - t0, 2)
        sched = fleet.stack.procs["scheduler"].popen.pid
        c, n = floors.cpu_s(sched), watch.heartbeats
        await asyncio.sleep(args.quiet_s)
        row["scheduler_cpu_s_per_heartbeat"] = (floors.cpu_s(sched) - c) / max(watch.heartbeats - n, 1)
        await run_job(fleet, job, metrics, row, counts[0], deadline, args.kill_after)
    except TimeoutError as e:
        row["status"] = f"time_limit: {e}"
    finally:
        if (run_dir / "logs" / "ps.log").exists():
            gemm_figures(row, run_dir / "logs" / "ps.log", watch.last_result)
        if bus is not None:
            with contextlib.suppress(Exception):
                await bus.close()
        fleet.stop()
    lines = MetricsTail(metrics).read()
    want = [m["loss"] for m in run_reference(job, tmp / f"ref{w}.jsonl")]
    row["steps_done"] = len(lines)
    row["steps_ok"] = sum(abs(m["loss"] - want[m["step"]]) <= 1e-4 * abs(want[m["step"]]) for m in lines)
    row["median_step_s"] = statistics.median(m["step_time_s"] for m in lines) if lines else None
    row["wall_s"] = round(time.monotonic() - t0, 1)
    return row


async def run_job(fleet: LocalFleet, job: JobConfig, metrics: Path, row: dict, victims: int, deadline: float,
                  kill_after: int) -> None:
    """Run the PS to the end; kill one swarm process after step `kill_after`; fill the PS-side figures (also
    from the steps it reached when the time limit strikes)."""
    fleet.start_ps(job, metrics, ps_env={"CLEAVE_LOG_JSON": "1", "CLEAVE_LOG_LEVEL": "debug"})
    ps = fleet.stack.procs["ps"].popen.pid
    tail, cpu_at, tiles, killed_at = MetricsTail(metrics), {}, {}, None
    try:
        while "ps" not in {p.name for p in fleet.stack.supervise()}:
            if time.monotonic() > deadline:
                row["ps_cpu_s_at_limit"] = floors.cpu_s(ps)  # since the PS started (its start-up included)
                raise TimeoutError(f"{len(cpu_at)} of {job.steps} steps done")
            for m in tail.read():
                cpu_at[m["step"]], tiles[m["step"]] = floors.cpu_s(ps), m["tiles"]
                if m["step"] == kill_after and killed_at is None:
                    fleet.stack.kill("swarm-0", signal.SIGKILL, restart=False)
                    killed_at = time.time()
            await asyncio.sleep(POLL_S)
    finally:
        ps_figures(fleet, row, cpu_at, tiles, killed_at, row["workers"] - victims)


def ps_figures(fleet: LocalFleet, row: dict, cpu_at: dict, tiles: dict, killed_at: float | None, smaller: int) -> None:
    done = sorted(cpu_at)
    if len(done) >= 2:
        row["ps_cpu_s_per_tile"] = (cpu_at[done[-1]] - cpu_at[done[0]]) / sum(tiles[s] for s in done[1:])
    applied = [e for e in log_events(fleet.run_dir / "logs" / "ps.log", "plan_applied")
               if killed_at and e["at"] > killed_at and e["workers"] == smaller]
    lost = [e["at"] for e in log_events(fleet.run_dir / "logs" / "scheduler.log", "worker_lost")
            if killed_at and e["at"] > killed_at and str(e.get("worker_id", "")).startswith("swarm-0-")]
    if applied:
        row["replan_s"] = applied[0]["at"] - killed_at
    if applied and lost:  # the scheduler saw the last of them go -> the PS applied the plan without them
        row["detect_s"] = max(lost) - killed_at
        row["replan_after_detect_s"] = applied[0]["at"] - max(lost)
        published = [e for e in log_events(fleet.run_dir / "logs" / "scheduler.log", "plan_published")
                     if e["at"] > killed_at and e.get("workers") == smaller]
        if published:  # the planner's own part of it (in the scheduler's planning process)
            row["plan_s"] = published[0].get("plan_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="10,100,1000", help="comma-separated swarm sizes")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--kill-after", type=int, default=2, help="kill 10%% of the swarm once this step is done")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--liveness-s", type=float, default=3.0)
    p.add_argument("--quiet-s", type=float, default=5.0, help="window for the scheduler's CPU per heartbeat")
    p.add_argument("--time-limit-s", type=float, default=600.0, help="per size; then report what it reached")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that every stack is stopped
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in (int(x) for x in args.workers.split(",")):
            rows.append(asyncio.run(run_size(w, args, Path(tmp))))
            print(json.dumps(rows[-1]), flush=True)
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(rows, indent=2))
    base = rows[0]
    for r in rows:
        ratio = (f"x{r['ps_cpu_s_per_tile'] / base['ps_cpu_s_per_tile']:.2f}"
                 if r["ps_cpu_s_per_tile"] and base["ps_cpu_s_per_tile"] else "-")
        print(f"{r['workers']:>6} workers: {r['status']}; steps ok {r['steps_ok']}/{r['steps']}; PS CPU/tile "
              f"{r['ps_cpu_s_per_tile']} ({ratio} of {base['workers']}); "
              f"GEMM tail {r['gemm_tail_s']} s; re-plan {r['replan_s']} s; scheduler CPU/heartbeat "
              f"{r['scheduler_cpu_s_per_heartbeat']}; wall {r['wall_s']} s")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
