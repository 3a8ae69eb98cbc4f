"""The local stack behind shaped links (cleave.runtime.netlab): nats-server, scheduler and PS in the hub namespace,
each worker in the namespace of its own link, dialling the hub over it.

`ShapedFleet` is a `LocalFleet` whose processes run inside a `Netlab`: the same supervision, logs, stack.json
and metrics tail, and `cut` / `restore` for a worker's link. Leaving it stops the processes and deletes the
namespaces. The root namespace cannot reach the hub: read the run through the run dir (logs, metrics) or
run a command inside the hub (`hub_run`).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cleave.errors import CleaveError
from cleave.runtime.netlab import HUB_PORT, Link, Netlab
from cleave_cli.jobrun import LocalFleet
from cleave_cli.natsconf import NATS_LIMITS, nats_server_binary
from cleave_cli.stack import DEFAULT_READY_TIMEOUT_S, Proc, Stack

HUB_NATS_CONFIG = """\
listen: 0.0.0.0:{port}
http: 127.0.0.1:8222
max_payload: {max_payload}
{limits}
jetstream {{
  store_dir: "{store}"
}}
"""


class NetStack(Stack):
    """A Stack whose processes run in the lab's namespaces: `placed[name]` is a link id, or None for the hub."""

    def __init__(self, run_dir: Path, lab: Netlab) -> None:
        super().__init__(run_dir)
        self.lab = lab
        self.placed: dict[str, str | None] = {}

    def start_nats(self) -> str:
        conf = self.run_dir / "nats.conf"
        conf.write_text(HUB_NATS_CONFIG.format(port=HUB_PORT, max_payload=self.max_payload, limits=NATS_LIMITS,
                                               store=(self.run_dir / "jetstream").as_posix()))
        proc = self.spawn("nats", "nats", [nats_server_binary(), "-c", str(conf)], restart=True)
        self.wait_ready(proc)
        self.nats_url = self.lab.nats_url()  # as seen inside the hub
        self.nats_monitor = "http://127.0.0.1:8222 (inside the hub namespace)"
        self.write_stack_json()
        return self.nats_url

    def service(self, name: str, role: str, args: list[str] = (), env: dict[str, str] | None = None,
                restart: bool = True, link: str | None = None) -> Proc:
        self.placed[name] = link
        argv = [sys.executable, "-m", "cleave_cli", role, "--nats", self.lab.nats_url(link), *args]
        return self.spawn(name, role, argv, env or {}, restart)

    def spawn(self, name: str, role: str, argv: list[str], env: dict[str, str] | None = None,
              restart: bool = True) -> Proc:
        link = self.placed.setdefault(name, None)
        ns = self.lab.hub if link is None else self.lab.ns(link)
        return super().spawn(name, role, self.lab.wrap(ns, argv), env, restart)


@dataclass
class ShapedFleet(LocalFleet):
    """nats, scheduler and PS in the hub; one worker per link (`links`), its id the link's id."""

    links: list[Link] = field(default_factory=list)
    lab: Netlab = field(init=False)

    def __post_init__(self) -> None:
        self.lab = Netlab(self.links)
        self.stack = NetStack(self.run_dir, self.lab)

    def start(self, with_fleet: bool = True) -> None:
        self.lab.create()
        try:
            self.stack.start_nats()
            self.stack.service("scheduler", "scheduler", env=self.scheduler_env)
            if with_fleet:
                for link in self.links:
                    self.add_link_worker(link.id)
        except BaseException:
            self.stop()
            raise

    def add_link_worker(self, link_id: str, env: dict[str, str] | None = None, restart: bool = True) -> str:
        """The worker behind link `link_id` (process name `worker-<id>`, worker id the link's id)."""
        name = f"worker-{link_id}"
        self.stack.service(name, "worker", ["--worker-id", link_id], env={**self.worker_env, **(env or {})},
                           restart=restart, link=link_id)
        return name

    def cut(self, link_id: str) -> None:
        self.lab.cut(link_id)

    def restore(self, link_id: str) -> None:
        self.lab.restore(link_id)

    def wait_log(self, name: str, text: str, timeout_s: float = DEFAULT_READY_TIMEOUT_S) -> None:
        """Until process `name` has logged `text` (its readiness line), or CleaveError."""
        log = self.run_dir / "logs" / f"{name}.log"
        deadline = time.monotonic() + timeout_s
        while not (log.exists() and text in log.read_text(errors="replace")):
            if time.monotonic() > deadline:
                raise CleaveError(f"{name} did not log {text!r} within {timeout_s}s; see {log}")
            time.sleep(0.05)

    def hub_run(self, argv: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        """Run a command inside the hub namespace (where NATS is reachable at `lab.nats_url()`)."""
        return subprocess.run(self.lab.wrap(self.lab.hub, argv), capture_output=True, text=True, timeout=timeout_s)

    def stop(self) -> None:
        try:
            self.stack.stop_all()
        finally:
            self.lab.teardown()

    def __enter__(self) -> ShapedFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
