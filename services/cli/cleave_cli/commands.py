"""The job-level commands: train and demo (`cleave up` is `up_cmd`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from pathlib import Path

from cleave.api import jobs
from cleave.api.fleet import LocalFleet, default_run_dir
from cleave.api.hub import connect as hub_connect
from cleave.errors import ConfigError, Stopped
from cleave.runtime import config_file
from cleave.runtime.logs import configure
from cleave.runtime.metrics_file import MetricsFile
from cleave.runtime.trackers import Trackers
from cleave.train import preflight
from cleave.train.job import ROUND_METHODS, JobConfig, new_job_id
from cleave_cli.joboptions import job_from_args
from cleave_cli.monitor_cmd import start_monitor
from cleave_cli.progress import ProgressBar, spent, unit_of
from cleave_ps.jobs.pretrain import fit, worker_budgets
from cleave_ps.settings import PsSettings
from cleave_worker.settings import WorkerSettings


def check_fits(job: JobConfig, workers: int, dry_run: bool, nats: str | None = None, replicas: int = 1,
               auth: Path | None = None) -> JobConfig:
    """The preflight (cleave.train.preflight): print the estimate for --dry-run; raise ConfigError if it cannot
    fit; the job with `recompute` decided. The workers' memory budgets: the registry's on a running stack
    (`nats`), else what a local stack's workers get (CLEAVE_WORKER_MEMORY_BYTES or their default)."""
    if job.method != "cleave":
        if dry_run:
            print(f"no preflight estimate for method {job.method!r} yet")
        return job
    job, est, memory = fit(PsSettings(replicas=replicas), job, workers)  # (the PS's own, as it will start)
    budgets = registry_budgets(nats, auth) if nats else [WorkerSettings().memory_bytes] * workers
    if dry_run:
        lay = est.layout
        print(f"preflight of job {job.job_id} ({job.model_name}, batch {job.batch_size} x seq {job.seq}, "
              f"{workers} workers; recompute {'on' if lay.recompute else 'off'}, {lay.micro_batches} micro-batch(es), "
              f"the head in {lay.head_chunks} chunk(s)):")
        print("\n".join("  " + line for line in est.lines() + memory.lines()))
        print("  " + workers_line(budgets, nats is not None))
    preflight.check(job, est, memory, budgets or preflight.DEFAULT_WORKER_MEMORY)
    if dry_run:
        print("fits")
    return job


def workers_line(budgets: list[int], registry: bool) -> str:
    if not budgets:
        return "workers      none registered yet: the default memory_bytes assumed"
    low, high = min(budgets) / 2**20, max(budgets) / 2**20
    return (f"workers      {len(budgets)}, memory_bytes " + (f"{low:.2f}" if low == high else f"{low:.2f}-{high:.2f}")
            + " MiB" + (" (the registry's)" if registry else " (a local stack's workers)"))


def registry_budgets(nats: str, auth: Path | None = None) -> list[int]:
    """The memory budgets the workers of a running stack declared (its registry); `auth`: log in as the PS."""
    async def read() -> list[int]:
        bus = await hub_connect(nats, auth, role="ps")  # (a clear error when NATS does not answer)
        try:
            return await worker_budgets(bus)
        finally:
            await bus.close()

    return asyncio.run(read())


def train(args: argparse.Namespace) -> int:
    configure("train", level="error")  # the client's reconnect chatter (a hub not up yet) is not for this user
    job = job_from_args(args)
    if args.config:  # the local stack's services read their tables of the same file ([ps], [worker], ...)
        os.environ[config_file.CONFIG_ENV] = str(args.config.resolve())
    jobs.check_auth(args.auth, args.nats)
    if args.ps_replicas < 1:
        raise ConfigError(f"--ps-replicas: must be at least 1, got {args.ps_replicas}")
    jobs.check_stack(job, args.workers, args.ps_replicas, local=args.nats is None and not args.reference)
    jobs.check_inputs(job)
    job = check_fits(job, args.workers, args.dry_run, args.nats if not args.reference else None, args.ps_replicas,
                     args.auth)
    if args.dry_run:
        return 0
    run_dir = args.run_dir or jobs.run_dir_of(job)  # the job's own: the same --job-id finds its state again
    metrics_out = jobs.writable(run_dir, args.metrics_out)
    unit = "step" if args.reference else unit_of(job.method)
    if args.reference and job.method in ROUND_METHODS:
        print(f"method {job.method} is approximate: --reference trains the exact baseline it is measured against, "
              "one plain AdamW step of the whole model per round on shard 0's batches (no workers, local steps, "
              "LoRA, compression or aggregation)")
    progress = ProgressBar(job.steps, unit=unit)
    trackers = Trackers(args.log_to, run_name=job.job_id, config=job.model_dump())
    aside = MetricsFile(metrics_out).aside(job.job_id)
    lines: list[dict] = []
    try:
        run_job(args, job, run_dir, metrics_out, progress, trackers, lines)
    except Stopped:
        if not args.reference:
            tell_stopped(job, lines, metrics_out, progress, trackers, unit, named=args.job_id is not None)
        raise
    finally:
        trackers.close()
    summarize(lines, metrics_out, unit)
    tell_after(job, lines, unit, metrics_out, aside, None if args.reference else run_dir / "logs" / "ps.log")
    return 0


def tell_after(job: JobConfig, lines: list[dict], unit: str, metrics_out: Path, aside: set[Path],
               ps_log: Path | None) -> None:
    """What a run did beside its steps: its metrics file's earlier lines set aside (`aside`: those already set
    aside before it), steps it was not asked for. `ps_log`: where the PS said why (None: no PS ran)."""
    why = (f"another job's, an earlier job {job.job_id} whose state is gone, or steps of a checkpoint that did "
           f"not read back: {ps_log} says which" if ps_log else "another run's")
    for kept in sorted(MetricsFile(metrics_out).aside(job.job_id) - aside):
        print(f"{metrics_out} held lines not of the model trained now ({why}): they are kept in {kept}")
    ran = max(MetricsFile(metrics_out).steps(), default=-1) + 1
    if ran > job.steps:
        print(f"job {job.job_id} had already run {ran} {unit}s, more than --steps {job.steps}: nothing was trained "
              f"(a larger --steps trains it further)")
    elif not lines and ran == job.steps:
        print(f"job {job.job_id} had already run its {ran} {unit}s: nothing was trained (a larger --steps trains it "
              f"further)")


def tell_stopped(job: JobConfig, lines: list[dict], metrics_out: Path, progress: ProgressBar, trackers: Trackers,
                 unit: str, named: bool = True) -> None:
    """A run stopped by a signal: the steps its PS committed after the last one shown (while the stack was shut
    down), and where the same command goes on (`named`: it gave the job's id; else it makes a new job)."""
    shown = max((m["step"] for m in lines), default=-1)
    committed = MetricsFile(metrics_out).lines()
    for m in committed:
        if m["step"] > shown:
            lines.append(m)
            progress.update(m)
            trackers.log(m)
    done = committed[-1]["step"] + 1 if committed else 0
    if progress.tty and lines and done < job.steps:
        print()  # (the bar's line stays as it was)
    again = "the same command" if named else f"the same command with --job-id {job.job_id}"
    print(f"job {job.job_id}: {unit}s 0-{done - 1} of {job.steps} are committed ({metrics_out}); {again} "
          f"resumes it from {unit} {done}" if done else f"job {job.job_id}: no {unit} was committed yet", flush=True)


def run_job(args: argparse.Namespace, job: JobConfig, run_dir: Path, metrics_out: Path, progress: ProgressBar,
            trackers: Trackers, lines: list[dict]) -> None:
    """The job here (`--reference`) or on the fleet, through the Python API (cleave.api.jobs.run); each metrics
    line shown, given to the trackers and added to `lines` (a resumed job's: from the first step it trains now,
    said first)."""

    def on_stack(fleet: LocalFleet) -> None:
        print(f"stack: {fleet.stack.nats_url}  run dir: {run_dir}")
        if args.nats is None:  # the local stack's own dashboard, live while the job runs
            print(f"dashboard: {start_monitor(fleet.stack, wait=False)}", flush=True)

    for m in jobs.run(job, workers=args.workers, run_dir=run_dir, nats=args.nats, auth=args.auth, metrics_out=metrics_out,
                        ps_replicas=args.ps_replicas, reference=args.reference, on_stack=on_stack):
        if not lines and m["step"] > 0:
            print(f"job {job.job_id} resumes from {unit_of(job.method)} {m['step']}: {unit_of(job.method)}s "
                  f"0-{m['step'] - 1} were committed by an earlier run ({metrics_out})", flush=True)
        lines.append(m)
        progress.update(m)
        trackers.log(m)


def summarize(lines: list[dict], metrics_out: Path, unit: str = "step") -> None:
    """One line: the loss from the first step to the last, the median step time. Each step counts once, by its
    last line (a job that found no state of its own starts over after its file's earlier lines were shown)."""
    lines = sorted({m["step"]: m for m in lines}.values(), key=lambda m: m["step"])
    if not lines:
        return
    times = [m["step_time_s"] for m in lines]
    first, last = lines[0], lines[-1]
    span = (f"loss {first['loss']:.4f} at {unit} {first['step']}" if len(lines) == 1 else
            f"loss {first['loss']:.4f} -> {last['loss']:.4f} over {unit}s {first['step']}-{last['step']} "
            f"({len(lines)} {unit}s)")
    eps = f"; {e}" if (e := spent(last)) else ""
    print(f"{span}; median {unit} {statistics.median(times):.3f}s{eps}; metrics in {metrics_out}")


def demo(args: argparse.Namespace) -> int:
    if args.steps is not None and args.steps < 1:  # (0 ran the default 30)
        raise ConfigError(f"--steps must be at least 1, got {args.steps}")
    if args.run_dir is not None and args.run_dir.is_dir() and any(args.run_dir.iterdir()):
        raise ConfigError(f"{args.run_dir} already holds a run: the demo starts afresh (its report counted the earlier "
                          "run's steps, and its kill was skipped): name a new folder, or leave out --run-dir")
    steps = args.steps or 30
    job = JobConfig.build(job_id=new_job_id("demo"), preset="small", steps=steps, batch_size=8, lr=2e-3,
                          warmup_steps=max(1, steps // 5))  # a short run: a fifth of it warms up (no spike)
    run_dir = args.run_dir or default_run_dir("demo")
    metrics_out = run_dir / "metrics.jsonl"
    fleet = LocalFleet(run_dir, 0, one_machine=True)
    progress = ProgressBar(job.steps)
    killed = {"at_step": job.steps // 2}

    def on_line(m: dict) -> None:
        progress.update(m)
        if "replacement" not in killed and fleet.stack.procs["worker-1"].poll() is not None:
            killed["replacement"] = fleet.add_worker()

    try:
        fleet.start()
        # worker-1 SIGKILLs itself as the first tile of the middle step reaches it: a death mid-GEMM
        fleet.add_worker(env={"CLEAVE_WORKER_FAIL_AT": f"tile:{killed['at_step']}",
                              "CLEAVE_WORKER_FAULT_DIR": str(run_dir / "faults")}, restart=False)
        for _ in range(args.workers - 1):
            fleet.add_worker()
        dashboard = start_monitor(fleet.stack)
        print(f"Cleave demo: preset {job.preset}, {args.workers} workers, {job.steps} steps; run dir {run_dir}")
        print(f"dashboard: {dashboard} (live while the demo runs)")
        fleet.start_ps(job, metrics_out)
        lines = fleet.wait_ps(metrics_out, on_line)
    finally:
        fleet.stop()
    summarize(lines, metrics_out)
    report_recovery(lines, killed)
    print(f"dashboard was at {dashboard}; the run dir {run_dir} keeps stack.json, logs and the metrics")
    return 0


CAUSES = {  # how a recovery's cause reads in the demo's report
    "tile_deadline": "went silent (its oldest tile passed its deadline)",
    "duplicates": "went silent (copies of its tiles on other workers kept finishing first)",
    "heartbeat_timeout": "left the plan (its heartbeats stopped)",
    "verification_mismatch": "returned a wrong block",
}


def report_recovery(lines: list[dict], killed: dict) -> None:
    if not killed:
        return
    times = [m["step_time_s"] for m in lines]
    median = statistics.median(times)
    # (started in its place once it was seen dead: in a short demo the job can end before the new one joins)
    print(f"worker-1 was killed (SIGKILL) in the middle of step {killed['at_step']}; " +
          (f"{killed['replacement']} was started in its place" if "replacement" in killed else
           "the job ended before a replacement was started"))
    events = [(m, ev) for m in lines for ev in m.get("recovery", [])]
    for m, ev in events:
        print(f"recovery in step {m['step']}: {ev['worker_id']} {CAUSES.get(ev['cause'], ev['cause'])} with tiles out for "
              f"{ev['detect_s']:.2f}s; they were re-sent within {ev['redispatch_s'] * 1e3:.0f} ms and done "
              f"{ev['complete_s']:.2f}s after detection; the step took {m['step_time_s']:.2f}s "
              f"({m['step_time_s'] - median:+.2f}s against the median step)")
    step = next((m for m in lines if m["step"] == killed["at_step"]), None)
    if not events and step is not None and step.get("tiles_copied"):
        print(f"its tiles in flight were finished by copies on other workers ({step['tiles_copied']} copied) before "
              f"it was missed; step {step['step']} took {step['step_time_s']:.2f}s ({step['step_time_s'] - median:+.2f}s "
              f"against the median step)")
    elif not events:
        print("the killed worker held no tiles when it died: nothing had to be re-sent")
    print(json.dumps({"median_step_s": round(median, 4), "final_loss": round(lines[-1]["loss"], 4),
                      "recoveries": len(events)}))
