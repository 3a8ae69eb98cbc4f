"""`cleave runner`: the command line of the hub's PS job runner, and the loop around it (`serve`): it connects as
the PS, opens the runner once the bus answers, takes submissions and looks after its PSs every DEFAULT_TICK_S,
and rides out a bus that is away (or a records' bucket that is full) with its PSs running on. What the runner
does is `cleave_cli.runner`."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import nats
import structlog

from cleave import auth
from cleave import bus as busmod
from cleave.api.stack import Stack
from cleave.bus.limits import STORE_FAILED
from cleave.errors import CleaveError, CreateRefused
from cleave.runtime.lifecycle import run as run_until_stopped
from cleave.runtime.lifecycle import wait_for_stop
from cleave.runtime.logs import configure
from cleave_cli.runner import (
    DEFAULT_MAX_QUEUED,
    DEFAULT_MAX_RUNNING,
    DEFAULT_TICK_S,
    MAX_QUEUED_ENV,
    RECORDS_FULL_HINT,
    Runner,
)
from cleave_ps.settings import PsSettings

log = structlog.get_logger("runner")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("runner", help="the hub's PS job runner: run jobs submitted with `cleave submit`")
    p.add_argument("--nats", help="NATS URL (default: the PS's setting, CLEAVE_PS_NATS_URL)")
    p.add_argument("--run-dir", type=Path, default=Path("runs") / "runner", help="jobs' files and PS logs")
    p.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, help="jobs run at once (default 1)")
    p.add_argument("--max-queued", type=int, default=None,
                   help=f"jobs waiting at once; more are refused (default ${MAX_QUEUED_ENV}, else {DEFAULT_MAX_QUEUED})")


def run(args: argparse.Namespace) -> int:
    configure("runner")
    settings = PsSettings(**({"nats_url": args.nats} if args.nats else {}))  # it logs in as the PS
    if args.max_running < 1:
        raise CleaveError(f"--max-running must be at least 1, got {args.max_running}")
    max_queued = args.max_queued
    if max_queued is None:
        given = os.environ.get(MAX_QUEUED_ENV, str(DEFAULT_MAX_QUEUED))
        if not given.strip().isdigit():
            raise CleaveError(f"{MAX_QUEUED_ENV} must be a whole number of jobs, got {given!r}")
        max_queued = int(given)
    if max_queued < 1:
        raise CleaveError(f"--max-queued ({MAX_QUEUED_ENV}) must be at least 1, got {max_queued}")
    return run_until_stopped(lambda stop: serve(settings, args.run_dir, args.max_running, stop, max_queued))


async def serve(s: PsSettings, run_dir: Path, max_running: int, stop: asyncio.Event,
                max_queued: int = DEFAULT_MAX_QUEUED) -> int:
    stack = Stack(run_dir)  # (a run dir it cannot make is named now, not once NATS answers)
    bus = await busmod.connect(s.nats_url, "cleave-runner", stop=stop, **auth.connect_options(s, "ps"))
    if bus is None:  # stopped before NATS answered
        return 0
    stack.nats_url = s.nats_url
    runner = Runner(bus, stack, run_dir, max_running, max_queued)
    try:
        while not stop.is_set():
            try:
                if runner.sub is None:  # opened once the bus answers: its records say which jobs to resume
                    await bus.setup()
                    await runner.open()
                    log.info("runner_started", nats=s.nats_url, run_dir=str(run_dir), max_running=max_running,
                             max_queued=max_queued, queued=sum(r.state == "queued" for r in runner.records.values()))
                await runner.take()
                await runner.tick()
            except (nats.errors.Error, TimeoutError, ConnectionError, CreateRefused) as e:  # the bus is away (or
                # cannot hold a bucket: it says why): its PSs go on
                if getattr(e, "err_code", None) == STORE_FAILED:  # (the one bucket it adds to)
                    log.error("job_records_full", detail=getattr(e, "description", ""), hint=RECORDS_FULL_HINT)
                else:
                    log.warning("runner_retrying", error=repr(e)[:200])
                await wait_for_stop(stop, DEFAULT_TICK_S)
    finally:
        await asyncio.to_thread(stack.stop_all)  # each PS drains; its job stays `running` and resumes next time
        await runner.close()
        await bus.close()
    return 0
