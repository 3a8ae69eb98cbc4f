"""The local stack: nats-server from the wheel plus the services as supervised processes.

Restarts a service that dies (as compose would; a crash loop, CRASH_LOOP_STARTS quick failures in a row, is
left down and told), records every process in `<run_dir>/stack.json`, and stops everything on exit. Each
process logs to `<run_dir>/logs/<name>.log`. Children die with the supervisor even when it is killed (see
cleave.api.supervisor). nats-server's HTTP monitoring port (`/varz`, `/connz`, `/jsz`) listens on 127.0.0.1 at
a free port, recorded as `nats_monitor`. With a `hub`
(`cleave up --listen/--auth`, cleave_cli.hub) the server listens where the hub says, with its credentials and
TLS, and each service logs in with its role's credential.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from cleave.api.forks import ENABLE_ENV, Forked, ForkServer, shared
from cleave.api.natsconf import NATS_CONFIG, NATS_LIMITS, free_port, nats_server_binary
from cleave.api.supervisor import HELD_DOWN_DIR, held_down, parent_death_signal, signals_held
from cleave.errors import EXIT_ERROR, EXIT_GROUP_LOST, NOT_RESTARTED, CleaveError
from cleave.runtime.files import write_atomic

DEFAULT_READY_TIMEOUT_S = 20.0
DEFAULT_STOP_GRACE_S = 10.0
LAST_WORDS_BYTES = 64 * 1024  # of a process's log read back for what it said last
# a crash loop, left down: this many failures in a row (a status of its own, not a signal's, not 0, not a
# replica's EXIT_GROUP_LOST, which asks for the restart), each within CRASH_WINDOW_S of its start
CRASH_LOOP_STARTS = 5
CRASH_WINDOW_S = 60.0
_log = structlog.get_logger("cleave.stack")
LOCK_FILE = "stack.lock"  # in a run dir, locked while a local stack runs there (`hold`)


@dataclass
class Proc:
    name: str
    role: str
    argv: list[str]
    env: dict[str, str]
    restart: bool
    popen: subprocess.Popen | Forked | None = None
    started_at: float = 0.0
    restarts: int = 0
    crashes: int = 0  # failures in a row, each soon after its start (a crash loop at CRASH_LOOP_STARTS)
    log_offset: int = 0  # size of its log when it last started: readiness is read from there on
    told: bool = False  # its end for good was reported (Stack.tell_ended)

    def poll(self) -> int | None:
        """Its exit status; None while it runs or before it first started."""
        with signals_held():
            return self.popen.poll() if self.popen else None

    def running(self) -> bool:
        """Started and not exited."""
        return self.popen is not None and self.poll() is None


class Stack:
    def __init__(self, run_dir: Path, max_payload: int = 8 * 1024 * 1024) -> None:
        self.run_dir = run_dir
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, Proc] = {}
        self.nats_url = ""
        self.nats_monitor = ""  # nats-server's HTTP monitoring endpoint, e.g. http://127.0.0.1:PORT
        self.dashboard_url = ""
        self.max_payload = max_payload
        self._nats_port = 0
        self._monitor_port = 0
        self.nodes: list = []  # cleave.api.topology.Node of a cluster (start_nats_cluster), else empty
        self.sites: dict = {}  # site name -> cleave.api.topology.Site (start_site)
        self.hub = None  # cleave_cli.hub.HubConfig: listeners, credentials and TLS of `cleave up --listen/--auth`
        self.leaf_url = ""  # where sites' leaf nodes dial this stack (a hub's), if anywhere
        # role -> exit codes not restarted (a worker that refused its settings would only refuse them again)
        self.stays_down: dict[str, tuple[int, ...]] = {"ps": NOT_RESTARTED, "worker": (EXIT_ERROR,)}
        self._down: set[str] = set()  # processes that ended and stay down, as stack.json last said
        self._forks: ForkServer | None = None  # forked its latest service (`forks_for`)

    # ---- nats ----------------------------------------------------------------------------------------
    def start_nats(self) -> str:
        """Start (or restart on the same port and store) the embedded nats-server; returns its URL."""
        self._nats_port = self._nats_port or free_port()
        self._monitor_port = self._monitor_port or free_port()
        conf = self.run_dir / "nats.conf"
        store = (self.run_dir / "jetstream").as_posix()
        if self.hub is not None:
            conf.write_text(self.hub.server_config(store, self._monitor_port, self.max_payload))
        else:
            conf.write_text(NATS_CONFIG.format(port=self._nats_port, monitor_port=self._monitor_port,
                                               max_payload=self.max_payload, limits=NATS_LIMITS, store=store))
        proc = self.spawn("nats", "nats", [nats_server_binary(), "-c", str(conf)], restart=True)
        self.wait_ready(proc)
        self.nats_url = self.hub.url if self.hub is not None else f"nats://127.0.0.1:{self._nats_port}"
        self.leaf_url = self.hub.leaf_url if self.hub is not None else self.leaf_url
        self.nats_monitor = f"http://127.0.0.1:{self._monitor_port}"
        self.write_stack_json()
        return self.nats_url

    def wait_ready(self, proc: Proc) -> None:
        log = self.log_path(proc.name)
        deadline = time.monotonic() + DEFAULT_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                said = self.last_words(proc)  # (its one-line reason: a port in use, a key that does not match, ...)
                raise CleaveError(f"nats-server exited with {proc.popen.returncode}"
                                  + (f": {said.split('] ', 2)[-1]}" if said else "") + f" (see {log})")
            with open(log, "rb") as f:
                f.seek(proc.log_offset)
                if b"Server is ready" in f.read():
                    return
            time.sleep(0.05)
        raise CleaveError(f"nats-server not ready after {DEFAULT_READY_TIMEOUT_S}s; see {log}")

    # ---- a nats cluster and site leaf nodes (cleave.api.topology) -------------------------------------
    def start_nats_cluster(self, size: int) -> str:
        """Start `size` routed nats-servers with JetStream (R3 where size >= 3) and leaf-node listeners;
        `nats_url` becomes their comma-separated list, which every service's connection accepts."""
        from cleave.api import topology

        self.nodes = self.nodes or [topology.Node(f"nats-{i + 1}") for i in range(size)]
        for node in self.nodes:
            conf = self.run_dir / f"{node.name}.conf"
            store = (self.run_dir / "jetstream" / node.name).as_posix()
            conf.write_text(topology.node_config(node, self.nodes, store, self.max_payload))
            self.spawn(node.name, "nats", [nats_server_binary(), "-c", str(conf)], restart=True)
        for node in self.nodes:
            self.wait_ready(self.procs[node.name])
        topology.wait_healthy([n.monitor for n in self.nodes], DEFAULT_READY_TIMEOUT_S)
        self.nats_url = ",".join(n.url for n in self.nodes)
        self.nats_monitor = self.nodes[0].monitor
        self.write_stack_json()
        return self.nats_url

    def start_site(self, name: str) -> str:
        """Start a leaf node for site `name`, dialling the cluster's leaf-node ports; returns the URL the
        site's workers connect to."""
        from cleave.api import topology

        if not self.nodes:
            self.start_nats_cluster(1)
        site = self.sites.get(name) or topology.Site(topology.check_site_name(name))
        self.sites[name] = site
        conf = self.run_dir / f"leaf-{name}.conf"
        conf.write_text(topology.leaf_config(site, self.nodes, self.max_payload))
        proc = self.spawn(f"nats-leaf-{name}", "nats", [nats_server_binary(), "-c", str(conf)], restart=True)
        self.wait_ready(proc)
        topology.wait_leaf_connected(site.monitor, DEFAULT_READY_TIMEOUT_S)
        self.write_stack_json()
        return site.url

    def topology_json(self) -> dict:
        """stack.json's view of the cluster nodes and the sites (empty for the single embedded server)."""
        if not self.nodes:
            return {}
        return {"nats_nodes": [{"name": n.name, "url": n.url, "monitor": n.monitor} for n in self.nodes],
                "sites": {s.name: {"url": s.url, "monitor": s.monitor} for s in self.sites.values()}}

    # ---- services ------------------------------------------------------------------------------------
    def service(self, name: str, role: str, args: list[str] = (), env: dict[str, str] | None = None,
                restart: bool = True) -> Proc:
        argv = [sys.executable, "-m", "cleave_cli", role, "--nats", self.nats_url, *args]
        logins = self.hub.env(role) if self.hub is not None else {}  # its credential and the CA
        return self.spawn(name, role, argv, {**logins, **(env or {})}, restart)

    def spawn(self, name: str, role: str, argv: list[str], env: dict[str, str] | None = None,
              restart: bool = True) -> Proc:
        proc = Proc(name, role, list(argv), dict(env or {}), restart)
        self.procs[name] = proc
        # a drill's hold (`cleave chaos ... --no-restart`) is on the process it stopped, not on a new one of that
        # name: a later stack in the run dir (a resumed job's, `runs/<job id>`) never restarted it otherwise
        (self.run_dir / HELD_DOWN_DIR / name).unlink(missing_ok=True)
        self._start(proc)
        return proc

    def log_path(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def last_words(self, proc: Proc) -> str:
        """What `proc` said last since it was last started, in its own words: its last `cleave: error:` line
        (without the prefix), else its last line; "" when it said nothing."""
        path = self.log_path(proc.name)
        try:
            with open(path, "rb") as f:
                f.seek(max(proc.log_offset, path.stat().st_size - LAST_WORDS_BYTES))
                lines = [x.strip() for x in f.read().decode(errors="replace").splitlines() if x.strip()]
        except OSError:
            return ""
        said = [x.removeprefix("cleave: error: ") for x in lines if x.startswith("cleave: error: ")]
        return said[-1] if said else (lines[-1] if lines else "")

    def _start(self, proc: Proc) -> None:
        log = self.log_path(proc.name)
        proc.log_offset = log.stat().st_size if log.exists() else 0
        self._down.discard(proc.name)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **proc.env}
        # nats-server closes its store on SIGTERM; a service is killed outright (as in a crash)
        on_orphaned = signal.SIGTERM if proc.role == "nats" else signal.SIGKILL
        with signals_held():  # a stop signal lands once the child is recorded
            forks = self.forks_for(proc.argv, env)
            if forks is not None:
                log.touch()  # (there once the service is started, as a process's of its own: the fork opens it)
                try:
                    proc.popen = forks.spawn(proc.argv, env, log, on_orphaned)
                except OSError as e:  # the fork server is gone (its log says why): a process of its own
                    _log.warning("fork_server_gone", service=proc.name, error=str(e))
                    forks = None
            if forks is None:
                with open(log, "ab") as logf:
                    proc.popen = subprocess.Popen(proc.argv, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                                  stdin=subprocess.DEVNULL, start_new_session=True,
                                                  preexec_fn=parent_death_signal(on_orphaned))  # noqa: PLW1509
        proc.started_at = time.time()
        self.write_stack_json()

    def forks_for(self, argv: list[str], env: dict[str, str]) -> ForkServer | None:
        """The fork server for a `python -m cleave_cli` service with environment `env` (this program's, shared
        with its other stacks: `forks.shared`), None where the service is to be a process of its own: another
        program, an environment a fork cannot take (`forks.interpreter_env`), not Linux, or CLEAVE_FORK_SERVER=0."""
        if argv[:3] != [sys.executable, "-m", "cleave_cli"] or os.environ.get(ENABLE_ENV, "1") == "0" \
                or not sys.platform.startswith("linux"):
            return None
        self._forks = shared(self.log_path("forkserver"), parent_death_signal(signal.SIGKILL))
        return self._forks if self._forks.fits(env) else None

    def supervise(self) -> list[Proc]:
        """Restart dead processes that should run; returns those that exited and stay down."""
        ended = []
        for proc in list(self.procs.values()):
            code = proc.poll()
            if code is None:
                continue
            stays_down = held_down(self.run_dir, proc.name) or code in self.stays_down.get(proc.role, ())
            if proc.restart and not stays_down and proc.crashes < CRASH_LOOP_STARTS:
                crashed = code > 0 and code != EXIT_GROUP_LOST and time.time() - proc.started_at < CRASH_WINDOW_S
                proc.crashes = proc.crashes + 1 if crashed else 0
                if proc.crashes < CRASH_LOOP_STARTS:
                    self.restart(proc.name)
                    continue
            ended.append(proc)
        if any(p.name not in self._down for p in ended):  # stack.json says so (`cleave chaos`, `status` read it)
            self._down.update(p.name for p in ended)
            self.write_stack_json()
        return ended

    def tell_ended(self, ended: list[Proc]) -> list[str]:
        """A line for each of `ended` (as `supervise` returns them) not told before: its exit status and last
        words (or that a drill holds it down), for a long-running stack's terminal."""
        lines = []
        for p in ended:
            if not p.told:
                p.told = True
                code = p.popen.returncode
                why = "held down (`cleave chaos ... --no-restart`)" if held_down(self.run_dir, p.name) else \
                    f"{killed_by(code) or self.last_words(p) or 'no output'} (see {self.log_path(p.name)})"
                if p.crashes >= CRASH_LOOP_STARTS:
                    why = f"it failed {p.crashes} times in a row, each within {CRASH_WINDOW_S:.0f} s of starting; {why}"
                lines.append(f"{p.name} stopped with status {code}, not restarted: {why}")
        return lines

    def restart(self, name: str) -> None:
        """Start process `name` again (it has exited), counting the restart."""
        proc = self.procs[name]
        proc.restarts += 1
        self._start(proc)
        if proc.role == "nats":
            self.wait_ready(proc)

    def kill(self, name: str, sig: int = signal.SIGKILL, restart: bool | None = None) -> None:
        proc = self.procs[name]
        if restart is not None:
            proc.restart = restart
        with signals_held():
            if proc.running():
                proc.popen.send_signal(sig)
                if sig == signal.SIGKILL:
                    proc.popen.wait()

    def stop_all(self, grace_s: float = DEFAULT_STOP_GRACE_S) -> None:
        """SIGTERM the services, then nats; SIGKILL whatever outlives the grace period. A stop signal that
        arrives meanwhile is raised once all are down (a second one exits at once)."""
        services = [p for p in self.procs.values() if p.role != "nats"]
        with signals_held():
            for group in (services, [p for p in self.procs.values() if p.role == "nats"]):
                for p in group:
                    p.restart = False
                    if p.running():
                        p.popen.terminate()
                deadline = time.monotonic() + grace_s
                for p in group:
                    try:
                        p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        p.popen.kill()
                        p.popen.wait()
            self.write_stack_json()

    def write_stack_json(self) -> None:
        doc = {
            "nats_url": self.nats_url,
            "nats_monitor": self.nats_monitor,
            "dashboard_url": self.dashboard_url,
            **({"leaf_url": self.leaf_url} if self.leaf_url else {}),
            "run_dir": str(self.run_dir),
            **self.topology_json(),
            "processes": [
                {"name": p.name, "role": p.role, "pid": p.popen.pid if p.popen else None,
                 "started_at": p.started_at, "restarts": p.restarts,
                 "running": p.running()}
                for p in self.procs.values()
            ],
        }
        write_atomic(self.run_dir / "stack.json", json.dumps(doc, indent=2))


def killed_by(status: int) -> str:
    """Why a process with a negative exit status ended, e.g. `killed by SIGKILL` (its last log line is no reason:
    the demo's victim said `worker_started`); "" for a status of its own."""
    if status >= 0:
        return ""
    return f"killed by {signal.Signals(-status).name}" if -status in signal.valid_signals() else f"killed by signal {-status}"


def hold(run_dir: Path, metrics: Path | None = None) -> int:
    """Lock `run_dir` for one stack or `--reference` run, or (`metrics`) a metrics file for the one job that
    writes it; returns the lock file's descriptor (closing it, or this process's end, frees it). Two stacks on
    one run dir (a second `cleave train` of the same job while the first runs) would share its JetStream store,
    whose checkpoints neither could then read back; two jobs on one metrics file would set each other's lines
    aside and write theirs into one file."""
    lock = run_dir / LOCK_FILE if metrics is None else metrics.parent / f".{metrics.name}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        who = f"another cleave{f' (pid {pid})' if pid else ''}"
        if metrics is not None:
            raise CleaveError(f"metrics file {metrics} (--metrics-out) is in use: {who} writes its job's steps "
                              "there; wait for it to end, or give this run another --metrics-out") from None
        # (a notebook's kernel: the pid named is its own, where it kept a run's steps in a variable, unfinished)
        own = (f"; pid {pid} is this process: a `run(...)` kept in a variable holds it until it ends or is closed "
               "(`.close()`)" if pid == str(os.getpid()) else "")
        raise CleaveError(f"{run_dir} is in use: {who} runs a job there (the same job started twice?); wait for "
                          f"it to end or stop it, or give this run another --run-dir (or --job-id){own}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
