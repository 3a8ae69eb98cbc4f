"""`cleave swarm`: N real workers in P processes against a NATS, a tool for load tests (docs/operations.md).

With `--processes 1` the workers run in this process (`cleave_worker.swarm.serve_swarm`). With more, this
process starts P such processes in their own sessions, forwards SIGINT/SIGTERM to each once (a second
signal kills them) and exits non-zero if any of them did.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
from pathlib import Path

from cleave.errors import ConfigError
from cleave.schemas.subjects import TOKEN_CHARS

ID_PREFIX = re.compile(f"[{TOKEN_CHARS}]{{1,96}}")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("swarm", help="run N real workers in P processes (a load-testing tool)")
    p.add_argument("--workers", type=int, required=True, help="workers in all")
    p.add_argument("--processes", type=int, default=1, help="processes to spread them over (default 1)")
    p.add_argument("--profile", help="declared device every worker paces itself to (default: measured once "
                                     "per process and shared)")
    p.add_argument("--prefix", default="swarm", help="worker ids are PREFIX-<process>-<i> (default swarm)")
    p.add_argument("--nats", help="NATS URL (default: the worker's setting, nats://127.0.0.1:4222)")
    p.add_argument("--heartbeat-s", type=float, help="seconds between a worker's heartbeats (default 0.25)")
    p.add_argument("--auth", type=Path, help="the folder with the worker credential (worker.env) and the CA: the "
                   "hub's `cleave auth init` output, or a site's sites/NAME (without it: CLEAVE_WORKER_NATS_NKEY_SEED)")
    p.add_argument("--process-index", type=int, default=0, help=argparse.SUPPRESS)  # set for the children


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {args.workers}")
    if not 1 <= args.processes <= args.workers:
        raise ConfigError(f"--processes must be between 1 and --workers ({args.workers}), got {args.processes}")
    if not ID_PREFIX.fullmatch(args.prefix):
        raise ConfigError(f"--prefix must be 1-96 letters, digits, '_' or '-', got {args.prefix!r}")
    if args.profile:
        from cleave.plan.profile import parse_profile

        parse_profile(args.profile)  # a bad one is refused here, not by each worker
    base = _settings(args)  # (wrong settings refused here, not by each process)
    if args.processes == 1:
        return _one_process(args, base)
    return _supervise(args)


def _settings(args: argparse.Namespace):  # noqa: ANN202 - a WorkerSettings (imported late: no torch here)
    from cleave_worker.settings import WorkerSettings

    fields = dict(nats_url=args.nats, profile=args.profile, heartbeat_s=args.heartbeat_s,
                  worker_id=f"{args.prefix}-{args.process_index}")
    if args.auth:
        from cleave.api import credentials

        fields.update(nats_nkey_seed=credentials.credential(args.auth, "worker", "worker").seed,
                      nats_tls_ca=credentials.ca_file(args.auth))
    settings = WorkerSettings(**{k: v for k, v in fields.items() if v is not None})
    if args.process_index == 0:  # (once, before any process)
        from cleave_cli.main import first_contact

        first_contact(settings, "worker", args.auth, "worker")
    return settings


def _one_process(args: argparse.Namespace, base) -> int:  # noqa: ANN001 - a WorkerSettings
    from cleave.runtime.lifecycle import run as run_service
    from cleave.runtime.logs import configure
    from cleave_worker.swarm import serve_swarm, swarm_ids

    configure("worker")
    ids = swarm_ids(args.prefix, args.process_index, args.workers)
    return run_service(lambda stop: serve_swarm(base, ids, stop))


def _supervise(args: argparse.Namespace) -> int:
    counts = [args.workers // args.processes + (i < args.workers % args.processes) for i in range(args.processes)]
    passed = [f for flag, value in (("--nats", args.nats), ("--profile", args.profile),
                                    ("--heartbeat-s", args.heartbeat_s), ("--auth", args.auth)) if value is not None
              for f in (flag, str(value))]
    children = [
        subprocess.Popen([sys.executable, "-m", "cleave_cli", "swarm", "--workers", str(n), "--processes", "1",
                          "--process-index", str(i), "--prefix", args.prefix, *passed], start_new_session=True)
        for i, n in enumerate(counts)
    ]
    signals = 0

    def on_signal(signum: int, frame: object) -> None:
        nonlocal signals
        signals += 1
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM if signals == 1 else signal.SIGKILL)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    codes = [c.wait() for c in children]
    print(f"cleave swarm: {args.workers} workers in {args.processes} processes stopped; exit codes {codes}",
          file=sys.stderr)
    return 0 if all(code == 0 for code in codes) else 1
