"""`cleave monitor` (the dashboard service) and starting the monitor inside the local stack."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from cleave.api.natsconf import free_port
from cleave.api.stack import Stack
from cleave.errors import CleaveError

DEFAULT_URL_TIMEOUT_S = 60.0  # the monitor imports torch (through the codec) before it binds its port
URL_FILE = "monitor.url"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `monitor` subcommand to the `cleave` parser."""
    p = subparsers.add_parser("monitor", help="serve the dashboard, Prometheus /metrics and the JSON API")
    p.add_argument("--nats", help="NATS URL (default: the service's setting, nats://127.0.0.1:4222)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 to publish the port)")
    p.add_argument("--port", type=int, help="port to listen on (default 8787; 0 = any free port)")
    p.add_argument("--url-file", type=Path, help="once serving, write the dashboard URL to this file")


def run(args: argparse.Namespace) -> int:
    """Run the monitor in this process until SIGTERM/Ctrl-C."""
    from cleave_monitor.main import main as monitor_main
    from cleave_monitor.settings import MonitorSettings

    fields = dict(nats_url=args.nats, host=args.host, port=args.port, url_file=args.url_file)
    return monitor_main(MonitorSettings(**{k: v for k, v in fields.items() if v is not None}))


def start_monitor(stack: Stack, port: int | None = None, timeout_s: float = DEFAULT_URL_TIMEOUT_S,
                  host: str = "127.0.0.1", token: str | None = None, wait: bool = True) -> str:
    """Start the monitor as a stack process, record its URL in stack.json; returns it (with `?token=` when
    it asks for one). `wait`: until it serves (else the URL is returned at once: it serves within seconds).

    The port is chosen here (a free one unless given), not by the monitor, so that a monitor the stack
    restarts comes back at the same URL. Calling this again replaces a running monitor.
    """
    url_file = stack.run_dir / URL_FILE
    url_file.unlink(missing_ok=True)
    if "monitor" in stack.procs:
        stack.kill("monitor", restart=False)
    port = port or free_port()
    env = {"CLEAVE_MONITOR_TOKEN": token} if token else {}
    proc = stack.service("monitor", "monitor", ["--host", host, "--port", str(port), "--url-file", str(url_file)],
                         env=env)
    log = stack.run_dir / "logs" / "monitor.log"
    deadline = time.monotonic() + timeout_s
    while wait and not url_file.exists():
        if proc.poll() is not None:
            said = stack.last_words(proc)
            raise CleaveError(f"the monitor exited with {proc.popen.returncode}" + (f": {said}" if said else "")
                              + f" (see {log})")
        if time.monotonic() > deadline:
            raise CleaveError(f"the monitor did not start serving within {timeout_s}s; see {log}")
        time.sleep(0.05)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    stack.dashboard_url = url_file.read_text().strip() if wait else f"http://{shown}:{port}"
    stack.write_stack_json()
    return f"{stack.dashboard_url}/?token={token}" if token else stack.dashboard_url
