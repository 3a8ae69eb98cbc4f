"""`cleave submit`, `cleave cancel`, `cleave forget` and `cleave status`: jobs on a hub, from anywhere that reaches
its NATS.

- `submit` builds the job from the same options as `cleave train`, publishes it on `cleave.jobs.submit.<job>`
  (JetStream keeps it on the hub) and returns once the hub has it: JetStream's acknowledgement, then the
  runner's verdict in the job's record (`cleave-jobs`), named by this submission's nonce. A refused job exits 2
  with the runner's reason; no verdict within `--wait` seconds (no runner up) still leaves the job on the hub.
- `cancel` publishes a cancel on the job's subject and returns once the runner has recorded the job `cancelled`
  (a running job's PS commits its step and stops; its checkpoint stays, and submitting the job again resumes it).
- `forget` (after a yes at the terminal, or `--yes`) publishes a forget on the job's subject and returns once the
  runner has deleted the job's record, having deleted its checkpoints, state, step lines and files first; a job
  that has not ended is refused (cancel it first).
- `status` reads the job records and the job's step metrics from the events stream (each step once, its last
  line): step, loss, done, workers; `--metrics-out` writes those lines in the `--metrics-out` format.
Each logs in with the submitter's credential found in `--auth DIR` (`cleave auth init`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

from cleave.api import hub
from cleave.errors import EXIT_ERROR, EXIT_INTERRUPTED, CleaveError, ConfigError
from cleave.runtime.logs import configure
from cleave.runtime.metrics_file import MetricsFile
from cleave.schemas import Event, JobRecord, StepMetrics
from cleave.schemas.jobs import ENDED
from cleave_cli import joboptions
from cleave_cli.progress import duration, unit_of


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit a job to a hub's runner (returns once the hub has it)")
    joboptions.register(p)
    _remote(p)
    p.add_argument("--workers", type=int, default=0, help="start once this many workers are registered on the hub "
                                                          "(at most a minute; default 0: at once)")
    p.add_argument("--wait", type=float, default=hub.DEFAULT_WAIT_S, help="seconds to wait for the hub to store the "
                   "job (its runner starting) and then for the runner's verdict")

    p = sub.add_parser("cancel", help="cancel a job on a hub: it does not start, or its PS commits and stops")
    _remote(p)
    p.add_argument("--job-id", required=True, help="the job to cancel")
    p.add_argument("--wait", type=float, default=hub.DEFAULT_WAIT_S, help="seconds to wait for the runner's answer")

    p = sub.add_parser("forget", help="delete an ended job from a hub: its checkpoints, metrics, files and record")
    _remote(p)
    p.add_argument("--job-id", required=True, help="the job to forget")
    p.add_argument("--yes", action="store_true", help="do not ask (needed where no terminal can be asked)")
    p.add_argument("--wait", type=float, default=hub.DEFAULT_WAIT_S, help="seconds to wait for the runner's answer")

    p = sub.add_parser("status", help="a hub's jobs, or one job's step, loss, workers and metrics")
    _remote(p)
    p.add_argument("--job-id", help="this job (default: list every job)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--metrics-out", type=Path, help="write the job's per-step metrics here (appended)")


def _remote(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", required=True, help="the hub's NATS URL, e.g. tls://hub.example.org:4222")
    p.add_argument("--auth", type=Path, help="the directory holding submitter.env (and the CA), from `cleave auth "
                                            "init`")


def quiet() -> None:
    """The client's reconnect chatter, and asyncio's note on every TLS connection's end, are not for this
    command's user."""
    logging.getLogger("asyncio").setLevel(logging.ERROR)


def run(args: argparse.Namespace) -> int:
    configure(args.command, level="error")
    quiet()
    if args.command == "submit":
        return submit(args)
    if args.command == "cancel":
        return cancel(args)
    if args.command == "forget":
        return forget(args)
    return asyncio.run(status(args))


# ---- submit ------------------------------------------------------------------------------------------
def submit(args: argparse.Namespace) -> int:
    job = joboptions.job_from_args(args, kind="job")
    follow = f"cleave status --nats {args.nats}{f' --auth {args.auth}' if args.auth else ''} --job-id {job.job_id}"

    def stored() -> None:  # (a Ctrl-C while the runner's answer is awaited leaves the job on the hub: say so first)
        print(f"{job.job_id}: stored on the hub; waiting up to {args.wait:g}s for its runner's answer",
              file=sys.stderr, flush=True)

    try:
        rec = hub.submit(job, args.nats, args.auth, min_workers=args.workers, wait_s=args.wait, on_stored=stored)
    except KeyboardInterrupt:
        print(f"{job.job_id}: no longer waiting; if it was stored, the job runs on the hub: {follow}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except CleaveError as e:
        if "refused" not in str(e):
            raise
        print(f"cleave: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    if rec is None:
        print(f"{job.job_id}: the hub's runner has not answered within {args.wait:.0f}s; the job waits on the hub "
              "for it", file=sys.stderr)
        return 0
    print(f"{job.job_id}: {rec.state}; follow it with: {follow}")
    return 0


# ---- cancel ------------------------------------------------------------------------------------------
def cancel(args: argparse.Namespace) -> int:
    async def go() -> tuple[JobRecord | None, JobRecord | None]:
        bus = await hub.connect(args.nats, args.auth)
        try:
            return await hub.cancel_on(bus, args.job_id, args.nats, args.wait)
        finally:
            await bus.close()

    try:
        before, rec = asyncio.run(go())
    except KeyboardInterrupt:
        print(f"{args.job_id}: no longer waiting; if the hub stored the cancel, its runner cancels the job",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if before is not None and before.state in ENDED:
        print(f"{args.job_id}: had already ended ({before.state}); nothing to cancel")
    elif rec is None:
        print(f"{args.job_id}: the hub's runner has not answered within {args.wait:.0f}s; the cancel waits on the "
              "hub for it", file=sys.stderr)
    else:
        print(f"{args.job_id}: cancelled; its checkpoint stays on the hub: submit the job again to resume it")
    return 0


# ---- forget ------------------------------------------------------------------------------------------
def forget(args: argparse.Namespace) -> int:
    what = f"job {args.job_id} on {args.nats}: its checkpoints, metrics, files and record, for good"
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"cleave forget deletes {what}; pass --yes to confirm where no terminal can be asked")
        try:
            answer = input(f"Delete {what}? [y/N] ")
        except EOFError:  # (Ctrl-D)
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print(f"{args.job_id}: kept")
            return 1
    try:
        gone = hub.forget(args.job_id, args.nats, args.auth, wait_s=args.wait)
    except KeyboardInterrupt:
        print(f"{args.job_id}: no longer waiting; if the hub stored the forget, its runner forgets the job",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if not gone:
        print(f"{args.job_id}: the hub's runner has not answered within {args.wait:.0f}s; the forget waits on the "
              "hub for it", file=sys.stderr)
        return 0
    print(f"{args.job_id}: forgotten: its checkpoints, step metrics and events, files and record are deleted; a "
          "new job of that id starts from step 0")
    return 0


# ---- status ------------------------------------------------------------------------------------------
async def status(args: argparse.Namespace) -> int:
    bus = await hub.connect(args.nats, args.auth)
    try:
        records = await hub.read_records(bus, args.job_id)
        if args.job_id is None:
            waits = await hub.read_waits(bus) if records else {}
            trims = await hub.read_trims(bus) if records else {}
            lasts = await hub.read_lasts(bus) if records and (args.json or waits) else {}
            waiting = [j for j in await hub.untaken(bus) if j not in {r.job_id for r in records}]
            show_list(records, lasts, waits, waiting, args.json, trims)
            return 0
        if not records and await hub.untaken(bus, args.job_id):
            if args.metrics_out:
                print(f"{args.job_id} has no step yet: {args.metrics_out} not written", file=sys.stderr)
            print(json.dumps(untaken_view(args.job_id)) if args.json else
                  f"{args.job_id}: submitted, waiting on the hub for its runner to take it (is `cleave up` running "
                  "there?)")
            return 0
        if not records:
            raise ConfigError(f"the hub knows no job {args.job_id!r} (cleave status --nats {args.nats} lists them)")
        lines = await hub.read_metrics(bus, args.job_id) if args.metrics_out else []
        progress = (await hub.read_lasts(bus, args.job_id)).get(args.job_id)
        wait = (await hub.read_waits(bus, args.job_id)).get(args.job_id)
        trim = (await hub.read_trims(bus, args.job_id)).get(args.job_id)
    finally:
        await bus.close()
    rec = records[0]
    if args.metrics_out:
        kept = mirror(args.metrics_out, args.job_id, lines)
        if kept is not None:
            print(f"{args.metrics_out} held another job's steps: set aside as {kept}", file=sys.stderr)
    view = hub.summary(rec, progress, wait=wait, trim=trim)
    print(json.dumps(view) if args.json else line(view))
    return 0


def untaken_view(job_id: str) -> dict:
    """`status --json` of a job submitted to the hub that no runner has taken yet."""
    return {"job": job_id, "state": "submitted", "runner_silent_s": None}


def mirror(path: Path, job_id: str, lines: list[StepMetrics]) -> Path | None:
    """Bring the metrics file `path` up to the hub's `lines` of job `job_id` (the steps it lacks appended). A
    file holding steps that are not this job's (another loss at a step, or a step the hub has not) is set aside
    first, as a PS does (it was left as it was, and none of this job's lines were written); its new name."""
    out, mine = MetricsFile(path), {m.step: m.loss for m in lines}
    kept = out.set_aside(job_id) if any(mine.get(m["step"]) != m.get("loss") for m in out.lines()) else None
    written = out.steps()
    for m in lines:
        if m.step not in written:
            out.write(m)
    return kept


def line(v: dict) -> str:
    unit = unit_of(v.get("method", "cleave"))
    where = (f"{unit} {v['step']} ({v['step'] + 1}/{v['steps']} done)" if v["step"] is not None
             else f"no {unit} yet of {v['steps']}")
    loss = f", loss {v['loss']:.4f}" if v["loss"] is not None else ""
    # (a PS waiting for workers has none: the count of its last step next to that read as a contradiction)
    workers = f", {v['workers']} workers" if v["workers"] is not None and not v.get("waiting_for_workers") else ""
    why = f"; {v['reason']}" if v["reason"] else ""
    refused = (f"; its last submission was refused: {v['last_submission']['reason']}"
               if v["last_submission"]["verdict"] == "refused" else "")
    return f"{v['job']}: {v['state']}, {where}{loss}{workers}{why}{refused}{idle(v)}{silent(v)}{trimmed(v)}"


def idle(v: dict) -> str:
    """The note on a running job whose PS has no worker to deal to (`hub.summary`'s `waiting_for_workers`)."""
    w = v.get("waiting_for_workers")
    if not w:
        return ""
    faulty = f"; {w['faulty']} expelled for wrong results" if w["faulty"] else ""
    return (f"; waiting for workers: its PS has had none to deal to for {duration(time.time() - w['since'])} "
            f"(since {time.strftime('%H:%M:%S', time.localtime(w['since']))}{faulty})")


def silent(v: dict) -> str:
    """The note on a queued or running job whose runner is gone (`hub.summary`'s `runner_silent_s`)."""
    if v["runner_silent_s"] is None:
        return ""
    return (f" (not heard from the hub's runner for {v['runner_silent_s'] / 60:.0f} min: is `cleave up` still "
            "running there? The job goes on once a runner is back)")


def trimmed(v: dict) -> str:
    """The note on a job whose trimmed mean dropped nothing in a round (`hub.summary`'s `trimmed_drops_nothing`)."""
    t = v.get("trimmed_drops_nothing")
    if not t:
        return ""
    return (f"; its trimmed mean dropped nothing in round {t['round']} ({t['updates']} updates, too few for trim "
            f"{t['trim']:g}): the plain mean was applied there (docs/methods.md: `median` for small fleets)")


def show_list(records: list[JobRecord], lasts: dict[str, tuple[StepMetrics, int]], waits: dict[str, Event],
              waiting: list[str], as_json: bool, trims: dict[str, Event] | None = None) -> None:
    """The hub's jobs; `lasts`: their progress (`hub.read_lasts`); `waits`: their PSs' latest word that they wait
    for workers; `trims`: that a round's trimmed mean dropped nothing; `waiting`: the jobs submitted that no
    runner has taken yet (no record)."""
    trims = trims or {}
    views = [hub.summary(r, lasts.get(r.job_id), wait=waits.get(r.job_id), trim=trims.get(r.job_id))
             for r in records]
    if as_json:
        print(json.dumps(views + [untaken_view(j) for j in waiting]))
        return
    if not records and not waiting:
        print("no jobs on this hub (it lists the jobs given with `cleave submit`; a `cleave train --nats` job's "
              "progress is in its own terminal and metrics file)")
    for j in waiting:
        print(f"{j:<40} {'submitted':<8} waiting on the hub for its runner to take it (is `cleave up` running there?)")
    for r, v in zip(records, views, strict=True):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.submitted_at))
        print(f"{r.job_id:<40} {r.state:<8} submitted {when}, {r.runs} run(s)" + (f"; {r.reason}" if r.reason else "")
              + idle(v) + silent(v) + trimmed(v))
