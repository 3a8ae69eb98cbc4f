"""The `cleave` command: run the services, a training job, the demo, or the local stack."""

from __future__ import annotations

import argparse
import atexit
import difflib
import gc
import importlib
import os
import signal
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from pydantic import ValidationError

from cleave.errors import EXIT_ERROR, EXIT_INTERRUPTED, CleaveError, Stopped
from cleave.runtime import config_file
from cleave_cli import joboptions

TOOLS = {"chaos": "chaos_cmd", "monitor": "monitor_cmd", "auth": "auth_cmd", "plan": "plan_cmd",
         "export": "export_cmd", "prepare-data": "data_cmd", "sim": "sim_cmd", "swarm": "swarm_cmd",
         "submit": "jobs_cmd", "cancel": "jobs_cmd", "forget": "jobs_cmd", "status": "jobs_cmd", "runner": "runner_cmd", "site": "site_cmd"}
# each module: register(sub) adds its subcommands, run(args) runs one
DISTRIBUTION = "cleave-train"  # the name on the package index (the import names are cleave, cleave_cli, ...)
LIGHT = ("chaos", "monitor", "scheduler", "submit", "cancel", "forget", "status")  # parsed alone, importing no other command, and run
# without torch (its import is 2 s of CPU on a laptop core): `cleave chaos kill` signals, the scheduler and the
# monitor start, a hub's jobs are submitted, cancelled, forgotten and listed. (No command's options import torch: each imports what it
# runs when it runs.)


def tool(name: str) -> ModuleType:
    return importlib.import_module(f"cleave_cli.{TOOLS[name]}")


def _service_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", help="NATS URL (default: the service's setting, nats://127.0.0.1:4222)")
    p.add_argument("--auth", type=Path, help="log in with this role's credential and the CA from this directory "
                                            "(`cleave auth init`'s, or a site's folder)")
    p.add_argument("--config", type=Path, help="a settings file (TOML): this service's table of it, e.g. [worker] "
                   "(environment variables and flags win over it; docs/user-guide.md, 'Settings file')")


def at_least(low: int):  # noqa: ANN201 - an argparse type
    """An argparse type: an integer no lower than `low`."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = "integer"  # argparse names it in "invalid integer value"
    return parse


def version() -> str:
    """The installed distribution's version (`cleave-train`), or "unknown" when run from a bare checkout."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


class CommandLine(argparse.ArgumentParser):
    """argparse's, with a mistake told in one line and where the options are, not the whole usage (23 lines
    for `cleave train`) before it; its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's
        """An option the command does not have is told by that command (argparse tells it at the top, pointing
        to `cleave --help`, which lists commands, not their options), with the option it may have meant."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            subs = next((a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction)), {})
            own = subs.get(getattr(ns, "command", None), self)
            close = [m for x in extras if x.startswith("-") for m in
                     difflib.get_close_matches(x.split("=", 1)[0], list(own._option_string_actions), n=1)]
            own.error(f"unrecognized arguments: {' '.join(extras)}" + (f"; did you mean {', '.join(close)}?" if close
                                                                       else ""))
        return ns


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (`only`, one of LIGHT) that subcommand alone, importing nothing else."""
    parser = CommandLine(prog="cleave", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cleave {version()} (Python {sys.version.split()[0]})")
    sub = parser.add_subparsers(dest="command", required=True)
    if only == "scheduler":
        _scheduler(sub)
        return parser
    if only in LIGHT:
        tool(only).register(sub)
        return parser

    p = sub.add_parser("demo", help="train the small GPT on a local fleet, kill a worker midway, report")
    p.add_argument("--workers", type=at_least(2), default=4, help="(one of them is killed midway)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--run-dir", type=Path)

    p = sub.add_parser("up", help="run nats, scheduler and workers in the foreground until Ctrl-C")
    p.add_argument("--workers", type=at_least(0), default=4, help="workers on this machine (0: a hub whose "
                   "workers are elsewhere)")
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--nats-cluster", type=at_least(0), default=0, metavar="N",
                   help="N routed nats-servers with JetStream replicated (R3 from 3) instead of one")
    p.add_argument("--site", action="append", default=[], metavar="NAME",
                   help="a leaf node for site NAME (repeatable); the workers are dealt to the sites in turn")
    p.add_argument("--listen", metavar="HOST[:PORT]", help="be a hub: NATS for clients on HOST:4222 and for sites' "
                   "leaf nodes on HOST:7422 (beyond this machine only with --auth)")
    p.add_argument("--leaf-port", type=int, default=7422, help="the leaf-node port with --listen (0: a free one)")
    p.add_argument("--auth", type=Path, help="credentials and TLS from `cleave auth init --out DIR`: the server's "
                   "users, and each service's own login")
    p.add_argument("--dashboard-listen", metavar="HOST[:PORT]", help="serve the dashboard there (default "
                   "127.0.0.1); beyond this machine it asks for a token, printed with its URL")
    p.add_argument("--max-running", type=at_least(1), default=1, help="submitted jobs run at once (default 1)")

    p = sub.add_parser("train", help="run one training job", description="Train one job: on a local stack of "
                       "--workers workers started for it (by default), on a running stack (--nats), or in this process "
                       "in plain PyTorch (--reference); one line a step, then a summary. The user guide has every "
                       "setting.")
    joboptions.register(p)
    p.add_argument("--workers", type=at_least(1), default=4, help="workers of the local stack (default 4)")
    p.add_argument("--nats", help="use this NATS (with its scheduler and workers) instead of a local stack")
    p.add_argument("--auth", type=Path, help="with --nats: log the PS in with the PS credential and the CA of this "
                   "directory (`cleave auth init`'s)")
    p.add_argument("--run-dir", type=Path, help="default: runs/<job id>, so that the same --job-id resumes")
    p.add_argument("--metrics-out", type=Path, help="one JSON line a committed step (default: <run dir>/metrics.jsonl); "
                   "appended to, another job's lines set aside")
    p.add_argument("--reference", action="store_true", help="run the same job in one process in plain PyTorch")
    p.add_argument("--ps-replicas", type=int, default=1, help="PS replicas, each training an equal share of every "
                   "batch with its own part of the fleet, gradients all-reduced (torch.distributed)")
    p.add_argument("--dry-run", action="store_true", help="print the preflight's memory estimate and exit")
    p.add_argument("--log-to", action="append", default=[], metavar="tensorboard:DIR|wandb:PROJECT",
                   help="also log every step's metrics to TensorBoard or Weights & Biases (repeatable; needs "
                        "the tensorboard or wandb extra)")

    for name in dict.fromkeys(TOOLS.values()):
        importlib.import_module(f"cleave_cli.{name}").register(sub)

    p = sub.add_parser("ps", help="run the parameter server")
    _service_args(p)
    p.add_argument("--job", type=Path, help="the job's file (TOML or JSON; default: --config's top-level keys)")
    p.add_argument("--metrics-out", type=Path, help="one JSON line a committed step (default: none, the events "
                   "stream only); appended to, another job's lines set aside")

    p = sub.add_parser("worker", help="run a worker")
    _service_args(p)
    p.add_argument("--worker-id")
    p.add_argument("--memory-bytes", type=int)
    p.add_argument("--profile", help="declared device to emulate: flops=..,down=..,up=..,latency=..,memory=..")
    p.add_argument("--data", help="this worker's own data (a data spec, as --data of train): the round methods and "
                                  "split learning train on it here; only its size is reported, never path or content")

    _scheduler(sub)
    return parser


def _scheduler(sub: argparse._SubParsersAction) -> None:
    _service_args(sub.add_parser("scheduler", help="run the scheduler"))


def _settings(cls, args: argparse.Namespace, **fields):
    values = {k: v for k, v in fields.items() if v is not None}
    if getattr(args, "nats", None):
        values["nats_url"] = args.nats
    role, folder = args.command, getattr(args, "auth", None)
    name = role
    if folder:  # <role>.env (a worker's own worker-<id>.env where there is one) and the CA
        from cleave.api import credentials

        own = f"worker-{args.worker_id}" if role == "worker" and args.worker_id else role
        name = own if (folder / f"{own}.env").is_file() else role
        cred = credentials.credential(folder, name, role)
        values["nats_nkey_seed"] = cred.seed
        if cred.companions:  # the scheduler's probe echo
            values["probe_nkey_seed"] = cred.companions[0].seed
        values["nats_tls_ca"] = credentials.ca_file(folder)
    settings = cls(**values)
    first_contact(settings, role, folder, name)
    return settings


def first_contact(settings, role: str, folder: Path | None, name: str) -> None:  # noqa: ANN001 - a service's settings
    """A refusal no retry mends is said now, not logged for ever: with `folder` (--auth), a certificate its CA
    did not sign, a credential the hub does not know, its leaf-node port; without, a server that asks for a
    credential. A hub that is not up (or not found yet: a machine still offline) is waited for, as always. A
    seed from the environment without `folder` (compose's) is left to the service's own logs."""
    if folder is None and settings.nats_nkey_seed:
        return
    import asyncio

    from cleave import auth
    from cleave.api import contact

    said = asyncio.run(contact.first_try(settings.nats_url, auth.connect_options(settings, role), folder, name))
    if said is not None and said.final and (folder is not None or said.credential):
        raise CleaveError(f"NATS at {settings.nats_url}: {said.reason}")


def run_service(args: argparse.Namespace) -> int:
    freeze_imports = gc.freeze  # what the imports made lives as long as the service: full collections skip it
    # (0.18 s each with torch loaded, one to five in a PS's run of a few minutes, each a pause inside a step)
    if args.config:  # the service's settings class reads its table of it (cleave.runtime.config_file)
        config_file.read(args.config)  # an unreadable file is the error to report, not a missing table
        os.environ[config_file.CONFIG_ENV] = str(args.config.resolve())
    if args.command == "ps":
        from cleave_ps.main import main as ps_main
        from cleave_ps.settings import PsSettings

        freeze_imports()
        return ps_main(_settings(PsSettings, args, job_file=args.job, metrics_out=args.metrics_out))
    if args.command == "worker":
        from cleave_worker.main import main as worker_main
        from cleave_worker.settings import WorkerSettings

        freeze_imports()
        return worker_main(_settings(WorkerSettings, args, worker_id=args.worker_id, memory_bytes=args.memory_bytes,
                                     profile=args.profile, data=args.data))
    from cleave_scheduler.main import main as scheduler_main
    from cleave_scheduler.settings import SchedulerSettings

    freeze_imports()
    return scheduler_main(_settings(SchedulerSettings, args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    atexit.unregister(gc.freeze)  # (once, however often main runs in one process)
    atexit.register(gc.freeze)  # the collector's last passes skip what exists at exit: with torch loaded they
    # took 1.2 s of CPU at the end of every command and service, 0.2 s without (objects are freed as always)
    try:  # (building the parser imports every command: a second in which a Ctrl-C may come)
        args = build_parser(argv[0] if argv and argv[0] in LIGHT else None).parse_args(argv)
        if args.command in ("ps", "worker", "scheduler"):
            return run_service(args)
        if args.command in TOOLS:
            return tool(args.command).run(args)
        from cleave.api.supervisor import stop_signals

        # (`up` supervises for as long as a hub runs: its module imports no torch, which train and demo need)
        commands = importlib.import_module("cleave_cli.up_cmd" if args.command == "up" else "cleave_cli.commands")
        try:
            with stop_signals():
                return getattr(commands, args.command)(args)
        except Stopped as e:
            print(f"cleave: stopped by {e}; the stack was shut down", file=sys.stderr)
            return e.exit_code
    except CleaveError as e:
        print(f"cleave: error: {e}", file=sys.stderr)
        return e.exit_code
    except ValidationError as e:  # a value the Python API refuses that no flag's own check caught
        print(f"cleave: error: {config_file.validation_message(e, e.title)}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # its reader is gone (`cleave ... | head`): end quietly, as SIGPIPE ends a program
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the flush at exit would fail again)
        return 128 + signal.SIGPIPE
    except OSError as e:  # a path it cannot read or write (a file given for a folder, no permission, ...)
        if e.filename is None:  # not about a path: a fault, with its traceback
            raise
        print(f"cleave: error: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # (`python -m cleave_cli.main`, as `python -m cleave_cli`)
    sys.exit(main())
