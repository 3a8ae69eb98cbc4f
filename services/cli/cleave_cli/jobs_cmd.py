"""`cleave submit` and `cleave status`: jobs on a hub, from anywhere that reaches its NATS.

- `submit` builds the job from the same options as `cleave train`, publishes it on `cleave.jobs.submit.<job>`
  (JetStream keeps it on the hub) and returns once the hub has it: JetStream's acknowledgement, then the
  runner's verdict in the job's record (`cleave-jobs`), named by this submission's nonce. A refused job exits 2
  with the runner's reason; no verdict within `--wait` seconds (no runner up) still leaves the job on the hub.
- `status` reads the job records and the job's step metrics from the events stream (each step once, its last
  line): step, loss, done, workers; `--metrics-out` writes those lines in the `--metrics-out` format.
Both log in with the submitter's credential found in `--auth DIR` (`cleave auth init`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import sys
import time
from pathlib import Path

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from cleave import bus as busmod
from cleave import codec
from cleave.errors import EXIT_ERROR, CleaveError, ConfigError, WireError
from cleave.runtime.logs import configure
from cleave.runtime.metrics_file import MetricsFile
from cleave.schemas import (
    EVENTS_STREAM,
    JOBS_BUCKET,
    MAX_CONTROL_BYTES,
    SUBJECT_EVENTS,
    SUBJECT_JOB_SUBMIT,
    JobRecord,
    JobSubmission,
    StepMetrics,
)
from cleave_cli import auth_cmd, joboptions
from cleave_cli.progress import unit_of

DEFAULT_CONNECT_TIMEOUT_S = 15.0
DEFAULT_WAIT_S = 30.0  # how long `submit` waits for the runner's verdict
DEFAULT_POLL_S = 0.25
DEFAULT_RETRY_S = 1.0  # between tries to store a job on a hub whose runner has not made its stream yet
DEFAULT_FETCH = 512  # metrics lines read per batch
DEFAULT_CONSUMER_IDLE_S = 30.0  # the server deletes `status`'s reading consumer this long after its last use


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="submit a job to a hub's runner (returns once the hub has it)")
    joboptions.register(p)
    _remote(p)
    p.add_argument("--workers", type=int, default=0, help="start once this many workers are registered on the hub "
                                                          "(at most a minute; default 0: at once)")
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, help="seconds to wait for the hub to store the "
                   "job (its runner starting) and then for the runner's verdict")

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
        return asyncio.run(submit(args))
    return asyncio.run(status(args))


async def connect(url: str, folder: Path | None, role: str = "submitter") -> busmod.Bus:
    """Log in at `url` as `role` with the credential in `folder`; a clear error when that cannot be done."""
    options = auth_cmd.client_options(folder, role)
    try:
        return await asyncio.wait_for(busmod.connect(url, f"cleave-{role}", **options), DEFAULT_CONNECT_TIMEOUT_S)
    except TimeoutError:
        raise CleaveError(f"could not reach NATS at {url} within {DEFAULT_CONNECT_TIMEOUT_S:.0f}s: check the URL, "
                          "that the port is open to you, and (tls://) the CA in --auth") from None


# ---- submit ------------------------------------------------------------------------------------------
async def submit(args: argparse.Namespace) -> int:
    job = joboptions.job_from_args(args, kind="job")
    sub = JobSubmission(job=job.model_dump_json(), nonce=secrets.token_hex(8), submitted_at=time.time(),
                        min_workers=args.workers)
    bus = await connect(args.nats, args.auth)
    try:
        ack = await store(bus, job.job_id, sub, args.wait, args.nats)
        print(f"{job.job_id}: stored on the hub (stream {ack.stream}, seq {ack.seq})", flush=True)
        rec = await verdict(bus, job.job_id, sub.nonce, args.wait)
    finally:
        await bus.close()
    if rec is None:
        print(f"{job.job_id}: the hub's runner has not answered within {args.wait:.0f}s; the job waits on the hub "
              "for it", file=sys.stderr)
        return 0
    if rec.verdict == "refused":
        print(f"cleave: error: the hub refused job {job.job_id}: {rec.verdict_reason}", file=sys.stderr)
        return EXIT_ERROR
    print(f"{job.job_id}: {rec.state}; follow it with: cleave status --nats {args.nats}"
          f"{f' --auth {args.auth}' if args.auth else ''} --job-id {job.job_id}")
    return 0


async def store(bus: busmod.Bus, job_id: str, sub: JobSubmission, wait_s: float, url: str):  # noqa: ANN201 - a PubAck
    """Publish the submission into the hub's JetStream; until `wait_s` while its stream is not there yet (a hub
    whose runner is starting). The message id is the nonce: a try whose answer was lost is stored once."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await bus.js.publish(SUBJECT_JOB_SUBMIT.format(job=job_id), codec.encode(sub),
                                        timeout=busmod.DEFAULT_TIMEOUT_S, headers={"Nats-Msg-Id": sub.nonce})
        except Exception as e:  # no stream (yet): no runner has started on that hub
            if time.monotonic() > deadline:
                raise CleaveError(f"the hub at {url} did not take the job within {wait_s:.0f}s ({type(e).__name__}): "
                                  "is its runner up (`cleave up`, or compose's `runner`)?") from None
        await asyncio.sleep(DEFAULT_RETRY_S)


async def verdict(bus: busmod.Bus, job_id: str, nonce: str, wait_s: float) -> JobRecord | None:
    """The job's record once it answers this submission (its nonce), or None after `wait_s`."""
    deadline = time.monotonic() + wait_s
    kv = None
    while time.monotonic() < deadline:
        try:
            kv = kv or await asyncio.wait_for(bus.js.key_value(JOBS_BUCKET), busmod.DEFAULT_TIMEOUT_S)
            got = await bus.kv_get(kv, job_id, JobRecord)
        except Exception:  # the bucket is not there yet (no runner so far)
            got = None
        if got is not None and got[0].nonce == nonce:
            return got[0]
        await asyncio.sleep(DEFAULT_POLL_S)
    return None


# ---- status ------------------------------------------------------------------------------------------
async def status(args: argparse.Namespace) -> int:
    bus = await connect(args.nats, args.auth)
    try:
        records = await read_records(bus, args.job_id)
        if args.job_id is None:
            show_list(records, args.json)
            return 0
        if not records:
            raise ConfigError(f"the hub knows no job {args.job_id!r} (cleave status --nats {args.nats} lists them)")
        lines = await read_metrics(bus, args.job_id)
    finally:
        await bus.close()
    rec = records[0]
    if args.metrics_out:
        out = MetricsFile(args.metrics_out)
        written = out.steps()
        for m in lines:
            if m.step not in written:
                out.write(m)
    view = summary(rec, lines)
    print(json.dumps(view) if args.json else line(view))
    return 0


async def read_records(bus: busmod.Bus, job_id: str | None) -> list[JobRecord]:
    try:
        kv = await asyncio.wait_for(bus.js.key_value(JOBS_BUCKET), busmod.DEFAULT_TIMEOUT_S)
    except Exception:
        return []  # no runner has ever run there
    if job_id is not None:
        got = await bus.kv_get(kv, job_id, JobRecord)
        return [got[0]] if got else []
    try:
        keys = await asyncio.wait_for(kv.keys(), busmod.DEFAULT_TIMEOUT_S)
    except Exception:  # nats-py raises NoKeysError for an empty bucket
        keys = []
    found = [await bus.kv_get(kv, k, JobRecord) for k in keys]
    return sorted((g[0] for g in found if g), key=lambda r: r.submitted_at)


async def read_metrics(bus: busmod.Bus, job_id: str) -> list[StepMetrics]:
    """The job's step lines from the events stream, in step order, each step once (its last line: a PS that
    resumed reports the lines of its last commit again)."""
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE,
                            inactive_threshold=DEFAULT_CONSUMER_IDLE_S)  # gone soon after this command
    sub = await asyncio.wait_for(bus.js.pull_subscribe(SUBJECT_EVENTS.format(kind="metrics"), stream=EVENTS_STREAM,
                                                       config=config), busmod.DEFAULT_TIMEOUT_S)
    steps: dict[int, StepMetrics] = {}
    try:
        while True:
            try:
                msgs = await sub.fetch(DEFAULT_FETCH, timeout=2.0)
            except TimeoutError:
                break  # nothing (more) there
            for m in msgs:
                try:
                    sm = codec.decode(m.data, StepMetrics, MAX_CONTROL_BYTES)
                except WireError:
                    continue
                if sm.job == job_id:
                    steps[sm.step] = sm
            if msgs[-1].metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return [steps[s] for s in sorted(steps)]


def summary(rec: JobRecord, lines: list[StepMetrics]) -> dict:
    job = json.loads(rec.job)
    steps = job.get("steps")
    last = lines[-1] if lines else None
    return {"job": rec.job_id, "state": rec.state, "done": rec.state == "done", "steps": steps,
            "method": job.get("method", "cleave"),
            "step": last.step if last else None, "steps_reported": len(lines),
            "loss": last.loss if last else None, "workers": last.workers if last else None,
            "submitted_at": rec.submitted_at, "started_at": rec.started_at, "ended_at": rec.ended_at,
            "runs": rec.runs, "exit_code": rec.exit_code, "reason": rec.reason,
            "last_submission": {"verdict": rec.verdict, "reason": rec.verdict_reason}}


def line(v: dict) -> str:
    unit = unit_of(v.get("method", "cleave"))
    where = (f"{unit} {v['step']} ({v['step'] + 1}/{v['steps']} done)" if v["step"] is not None
             else f"no {unit} yet of {v['steps']}")
    loss = f", loss {v['loss']:.4f}" if v["loss"] is not None else ""
    workers = f", {v['workers']} workers" if v["workers"] is not None else ""
    why = f"; {v['reason']}" if v["reason"] else ""
    refused = (f"; its last submission was refused: {v['last_submission']['reason']}"
               if v["last_submission"]["verdict"] == "refused" else "")
    return f"{v['job']}: {v['state']}, {where}{loss}{workers}{why}{refused}"


def show_list(records: list[JobRecord], as_json: bool) -> None:
    if as_json:
        print(json.dumps([summary(r, []) for r in records]))
        return
    if not records:
        print("no jobs on this hub")
    for r in records:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.submitted_at))
        print(f"{r.job_id:<40} {r.state:<8} submitted {when}, {r.runs} run(s)" + (f"; {r.reason}" if r.reason else ""))
