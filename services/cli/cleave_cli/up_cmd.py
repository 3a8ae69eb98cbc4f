"""`cleave up`: a stack in the foreground (NATS, scheduler, workers, the hub's runner and the dashboard) until
Ctrl-C. Its process only supervises: it never imports torch (2 s of CPU and ~200 MB a hub would hold for as long
as it runs); the services it starts hold what they need.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time

from cleave.api.fleet import LocalFleet, default_run_dir
from cleave.errors import ConfigError, Stopped
from cleave.runtime.files import write_atomic
from cleave_cli.hub import LOOPBACK, HubConfig, split_listen
from cleave_cli.monitor_cmd import start_monitor


def up(args: argparse.Namespace) -> int:
    run_dir = args.run_dir or default_run_dir("up")
    as_hub = args.listen is not None or args.auth is not None
    if as_hub and (args.nats_cluster or args.site):
        raise ConfigError("--listen/--auth run one hub server; --nats-cluster and --site emulate a topology on this "
                          "machine: use one or the other (docs/deploy.md)")
    # the dashboard's address (a wrong one refused before anything starts); 127.0.0.1 at a free port by default
    where = split_listen(args.dashboard_listen, 0, "--dashboard-listen") if args.dashboard_listen \
        else ("127.0.0.1", 0)
    hub = HubConfig.of(args.listen, args.auth, args.leaf_port) if as_hub else None
    # on the loopback no worker can dial in from elsewhere: the fleet is this machine's
    fleet = LocalFleet(run_dir, 0, nats_cluster=args.nats_cluster, sites=tuple(args.site),
                       one_machine=hub is None or hub.host in LOOPBACK)
    fleet.stack.hub = hub
    try:
        fleet.start()
        if hub is not None:
            hub.check_login()
            if said := hub.sites_with_hub_keys():
                print(f"warning: {said}", file=sys.stderr)
        for _ in range(args.workers):
            fleet.add_worker()
        fleet.stack.service("runner", "runner", ["--run-dir", str(run_dir / "runner"),
                                                 "--max-running", str(args.max_running)])
        print(f"NATS {fleet.stack.nats_url} (monitoring {fleet.stack.nats_monitor}); stack.json in {run_dir}")
        if fleet.stack.leaf_url:
            print(f"sites dial {fleet.stack.leaf_url}: cleave site --hub {fleet.stack.leaf_url} --name NAME --auth "
                  "<its folder of `cleave auth init --sites NAME`>")
            if hub is not None and (unnamed := hub.leaf_unnamed()):
                print(f"warning: {unnamed}", file=sys.stderr)
        for name, site in fleet.stack.sites.items():
            print(f"site {name}: leaf node {site.url} (monitoring {site.monitor}); its workers connect there")
        print(f"dashboard: {dashboard(fleet.stack, *where)}")
        auth = f" --auth {args.auth}" if args.auth else ""
        print(f"submit jobs with: cleave submit --nats {fleet.stack.nats_url}{auth} --preset tiny "
              f"(or train in the foreground: cleave train --nats {fleet.stack.nats_url}{auth} --preset tiny)")
        print("Ctrl-C (or SIGTERM, SIGHUP) stops everything", flush=True)
        while True:
            for line in fleet.stack.tell_ended(fleet.stack.supervise()):
                print(line, flush=True)
            time.sleep(0.2)
    except Stopped:  # (the signal handler said it stops)
        return 0
    finally:
        fleet.stop()


def dashboard(stack, host: str, port: int) -> str:  # noqa: ANN001 - a Stack
    """Start the monitor on host:port (0: a free one); beyond this machine with a token, kept in the run dir
    (monitor.token, 0600). Returns the URL to open (with the token)."""
    token = None if host in LOOPBACK else secrets.token_urlsafe(24)
    if token:
        write_atomic(stack.run_dir / "monitor.token", token + "\n", 0o600)
    return start_monitor(stack, port=port or None, host=host, token=token)
