"""Running one training job: the distributed way on a (local or given) stack, or the reference way."""

from __future__ import annotations

import json
import os
import re
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cleave.api.natsconf import free_port
from cleave.api.stack import CRASH_LOOP_STARTS, CRASH_WINDOW_S, Stack, hold
from cleave.errors import CleaveError, PsEnded
from cleave.runtime import config_file
from cleave.runtime.memory import peak_rss_bytes
from cleave.runtime.metrics_file import EXCLUDED, MetricsFile
from cleave.schemas import StepMetrics
from cleave.schemas.subjects import MAX_WORKER_ID, token
from cleave.train.job import JobConfig
from cleave.train.schedule import lr_at

JOIN_WAIT_S = 60.0  # how long a local PS waits for the stack's workers to join before it starts
JOINED = re.compile(r"worker_joined .*?worker_id=(\S+)")  # the scheduler's log line for a join

DEFAULT_POLL_S = 0.2
CHUNKS_ENV = "CLEAVE_SCHEDULER_CHUNKS"


def one_machine_chunks() -> dict[str, str]:
    """The scheduler's environment for a fleet on this machine: planned blocks sent whole (chunks 1), since every
    piece costs CPU that the PS, the workers and nats-server share here and streaming saves nothing on loopback
    (docs/planning.md); nothing where the environment or the settings file's [scheduler] table sets chunks."""
    path = os.environ.get(config_file.CONFIG_ENV)
    table = config_file.read(path).get("scheduler") if path else None  # not a table: the scheduler says so
    if CHUNKS_ENV in os.environ or (isinstance(table, dict) and "chunks" in table):
        return {}
    return {CHUNKS_ENV: "1"}


def worker_id(run_name: str, n: int) -> str:
    """The id of a stack's `n`th worker: its run dir's name, where every character an id may not hold (it is
    one subject token: letters, digits, _ and -) is a -, cut to leave room for `-w<n>` within 128."""
    tail = f"-w{n}"
    return (token(run_name) or "run")[: MAX_WORKER_ID - len(tail)] + tail


def default_run_dir(kind: str) -> Path:
    """A new folder runs/<kind>-<date>-<time>, made here: of two commands started in the same second, the
    second gets <...>-2 (it was refused as the first's run dir in use)."""
    base = Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    base.parent.mkdir(parents=True, exist_ok=True)
    folder, n = base, 1
    while True:
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            n += 1
            folder = base.with_name(f"{base.name}-{n}")


def reference_steps(job: JobConfig, metrics_out: Path) -> Iterator[dict]:
    """The identical job in this process in plain PyTorch (same seed, same batches, same optimizer): each step's
    metrics line as it is written to `metrics_out`."""
    from cleave.train.trainer import Trainer  # noqa: PLC0415 - (torch: a stack's commands start without it)

    trainer = Trainer(job)
    trainer.hold_optimizer_state()  # its peak from the first step, as the PS's
    out = MetricsFile(metrics_out)
    out.set_aside(job.job_id)  # a fresh run of its own: earlier lines there are kept under another name
    for step in range(job.steps):
        t0 = time.perf_counter()
        loss = trainer.step(step)
        val = trainer.val_loss(step) if job.val_every and (step + 1) % job.val_every == 0 else None
        m = StepMetrics(job=job.job_id, step=step, loss=loss, step_time_s=time.perf_counter() - t0, workers=0,
                        tokens=job.batch_size * job.seq, lr=lr_at(job, step), val_loss=val,
                        peak_rss_bytes=peak_rss_bytes())
        out.write(m)
        yield m.model_dump(exclude=EXCLUDED)


def run_reference(job: JobConfig, metrics_out: Path, on_line: Callable[[dict], None] | None = None) -> list[dict]:
    """`reference_steps`, run to the end; each line also given to `on_line`."""
    lines = []
    for m in reference_steps(job, metrics_out):
        lines.append(m)
        if on_line:
            on_line(m)
    return lines


class MetricsTail:
    """Reads the JSON lines the PS appends, one complete line at a time; a file set aside and begun anew
    (`MetricsFile.set_aside`, by a PS that found no state of its job) is read again from its start.
    `new_only`: the lines the file holds now (a resumed job's earlier steps) are not returned, nor the same lines
    copied into a file begun anew (`MetricsFile.cut_after`); `last` counts them all the same."""

    def __init__(self, path: Path, new_only: bool = False) -> None:
        self.path, self.pos, self.buf, self.inode = path, 0, b"", None
        self.last: int | None = None  # the latest step read (of the file read now)
        self.held: set[str] = set()
        if new_only:
            self.held = {_key(m) for m in self.read()}

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_ino != self.inode or st.st_size < self.pos:  # another file now: from its start
                self.inode, self.pos, self.buf, self.last = st.st_ino, 0, b"", None
            f.seek(self.pos)
            got = f.read()
        self.pos += len(got)
        *lines, self.buf = (self.buf + got).split(b"\n")
        read = [json.loads(line) for line in lines if line.strip()]
        steps = [m["step"] for m in read if self.last is None or m["step"] > self.last]
        self.last = max(steps, default=self.last)
        return [m for m in read if _key(m) not in self.held] if self.held else read


class LogTail:
    """What a process adds to its log, read as it comes: whether a new line holds a word."""

    def __init__(self, path: Path, pos: int = 0) -> None:
        self.path, self.pos, self.told = path, pos, False

    def saw(self, word: bytes) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                got = f.read()
        except OSError:  # (not written yet)
            return False
        self.pos += len(got)
        return word in got


def _key(m: dict) -> str:
    return json.dumps(m, sort_keys=True)


@dataclass
class LocalFleet:
    """A stack on this machine: nats (unless given), scheduler, workers, and the PS for one job."""

    run_dir: Path
    workers: int
    nats_url: str | None = None
    worker_env: dict[str, str] = field(default_factory=dict)
    scheduler_env: dict[str, str] = field(default_factory=dict)
    nats_cluster: int = 0  # > 0: that many routed nats-servers (JetStream R3 from 3) instead of one
    sites: tuple[str, ...] = ()  # a leaf node per site; the workers are dealt to the sites in turn
    one_machine: bool = False  # every worker runs here: the scheduler sends planned blocks whole (`one_machine_chunks`)
    stack: Stack = field(init=False)
    next_worker: int = 0
    ps_names: list[str] = field(default_factory=lambda: ["ps"])  # the PS, or its replicas
    job: JobConfig | None = None  # the job of the PS (`start_ps`)

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # one stack a run dir, refused before anything of it is written; freed by stop, or when the fleet is
        # collected, or with this process
        self.unlock = weakref.finalize(self, os.close, hold(self.run_dir))
        self.stack = Stack(self.run_dir)

    def start(self, with_fleet: bool = True) -> None:
        if self.nats_url:
            self.stack.nats_url = self.nats_url
        elif self.nats_cluster or self.sites:
            self.start_topology()
        else:
            self.stack.start_nats()
        if with_fleet:
            whole = one_machine_chunks() if self.one_machine else {}
            self.stack.service("scheduler", "scheduler", env={**whole, **self.scheduler_env})
            for _ in range(self.workers):
                self.add_worker()

    def start_topology(self) -> None:
        """The hub (a cluster of `nats_cluster` servers, or one) and a leaf node per site."""
        self.stack.start_nats_cluster(max(1, self.nats_cluster))
        for site in self.sites:
            self.stack.start_site(site)

    def add_worker(self, env: dict[str, str] | None = None, restart: bool = True, site: str | None = None) -> str:
        """One more worker, on `site`'s leaf node (by default the next site in turn, if there are sites)."""
        self.next_worker += 1
        name = f"worker-{self.next_worker}"
        site = site or (self.sites[(self.next_worker - 1) % len(self.sites)] if self.sites else None)
        via = ["--nats", self.stack.sites[site].url] if site else []  # the later --nats wins
        self.stack.service(name, "worker", ["--worker-id", worker_id(self.run_dir.name, self.next_worker), *via],
                           env={**self.worker_env, **(env or {})}, restart=restart)
        return name

    def start_ps(self, job: JobConfig, metrics_out: Path, ps_env: dict[str, str] | None = None,
                 replicas: int = 1, replica_env: dict[int, dict[str, str]] | None = None) -> None:
        """The PS, or `replicas` PS replicas named ps-0, ps-1, ... (replica 0 writes the metrics; each may get
        extra `replica_env`), rendezvousing on a free local port."""
        self.wait_joined()
        self.job = job
        job_file = self.run_dir / "job.json"
        job_file.write_text(job.model_dump_json(indent=2))
        args = ["--job", str(job_file)]  # the PS appends to metrics_out (a resumed job's lines follow its own)
        if replicas == 1:
            self.ps_names = ["ps"]
            self.stack.service("ps", "ps", [*args, "--metrics-out", str(metrics_out)], env=ps_env)
            return
        self.ps_names = [f"ps-{r}" for r in range(replicas)]
        group = {"CLEAVE_PS_REPLICAS": str(replicas), "CLEAVE_PS_REPLICA_PORT": str(free_port())}
        for r, name in enumerate(self.ps_names):
            env = {**(ps_env or {}), **group, "CLEAVE_PS_REPLICA": str(r), **(replica_env or {}).get(r, {})}
            self.stack.service(name, "ps", [*args, "--metrics-out", str(metrics_out)] if r == 0 else args, env=env)

    def wait_joined(self, timeout_s: float = JOIN_WAIT_S) -> None:
        """Until the stack's scheduler has seen as many workers join as this stack started (a worker joins once
        it has measured its links), so that the first step or round has them all; after `timeout_s` the PS
        starts anyway and deals to those that are there."""
        want = sum(p.role == "worker" for p in self.stack.procs.values())
        log = self.run_dir / "logs" / "scheduler.log"
        if not want or "scheduler" not in self.stack.procs:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # (distinct ids: a worker that joins again counts once)
            if log.exists() and len(set(JOINED.findall(log.read_text(errors="replace")))) >= want:
                return
            self.stack.supervise()  # (one that died meanwhile is started again now, not 60 s later)
            for p in self.stack.procs.values():  # one that refused its settings would only refuse them again
                if p.role == "worker" and p.poll() in self.stack.stays_down["worker"]:
                    raise CleaveError(f"{p.name} could not start: {self.stack.last_words(p) or 'no output'} "
                                      f"(see {self.stack.log_path(p.name)})")
            time.sleep(0.1)

    def follow_ps(self, metrics_out: Path, timeout_s: float | None = None, new_only: bool = False) -> Iterator[dict]:
        """Supervise until the PS finishes the job, yielding each metrics line as the PS commits its step (with
        `new_only`, not those `metrics_out` held before: `MetricsTail`); a PS that ends with an error raises
        CleaveError naming its log."""
        tail = MetricsTail(metrics_out, new_only)
        ps = self.stack.procs[self.ps_names[0]]  # (its log from its start on: `waiting_for_workers`, told once)
        idle = LogTail(self.stack.log_path(ps.name), ps.log_offset)
        deadline = time.monotonic() + timeout_s if timeout_s else None
        while True:
            if got := tail.read():
                idle.told = False  # (a step came: a later wait is told again)
            yield from got
            if not idle.told and idle.saw(b"waiting_for_workers"):
                self.tell_idle(idle)
            down = {p.name: p for p in self.tell(self.stack.supervise()) if p.name in self.ps_names}
            for name, p in down.items():  # a PS that ended for good with an error ends the run (its replicas
                if p.popen.returncode != 0:  # would wait for it for ever)
                    said = self.stack.last_words(p)
                    loop = (f"it failed {p.crashes} times in a row, each within {CRASH_WINDOW_S:.0f} s of starting; "
                            if p.crashes >= CRASH_LOOP_STARTS else "")
                    raise PsEnded(f"the parameter server {name} exited with {p.popen.returncode}: {loop}"
                                  f"{said or 'no output'} (see {self.stack.log_path(name)})", p.popen.returncode)
            if down:
                yield from tail.read()  # (the lines it wrote before it ended)
                if self.job is not None and not self.job.finished_at(tail.last):  # stopped from outside (SIGTERM)
                    for name in down:
                        self.stack.restart(name)  # short of the last step: it resumes, as the hub's runner does
                elif len(down) == len(self.ps_names):
                    return
            if deadline and time.monotonic() > deadline:
                raise CleaveError(f"the job did not finish within {timeout_s}s; see {self.run_dir}/logs")
            time.sleep(DEFAULT_POLL_S)

    def tell_idle(self, idle: LogTail) -> None:
        """Say on stderr that the PS has no worker to deal to (its log said `waiting_for_workers`): a terminal
        that showed only the stack's line while the PS waited, with no worker on a stack given by --nats."""
        idle.told = True
        where = (f"start some on {self.nats_url} (`cleave worker --nats URL`, `cleave up --workers N`, a site)"
                 if self.nats_url else "the stack's workers have not joined (see their logs)")
        print(f"cleave: the parameter server has no worker to deal to and waits for one: {where}; its log: "
              f"{idle.path}", file=sys.stderr, flush=True)

    def tell(self, ended: list) -> list:
        """Say on stderr, once each, which of `ended` (as `Stack.supervise` returns them) stay down and why (a
        PS's own words end the run instead); `ended`."""
        for line in self.stack.tell_ended([p for p in ended if p.name not in self.ps_names]):
            print(line, file=sys.stderr, flush=True)
        return ended

    def wait_ps(self, metrics_out: Path, on_line=None, timeout_s: float | None = None) -> list[dict]:
        """`follow_ps` to the end: the metrics lines; each also given to `on_line`."""
        lines = []
        for m in self.follow_ps(metrics_out, timeout_s):
            lines.append(m)
            if on_line:
                on_line(m)
        return lines

    def stop(self) -> None:
        self.stack.stop_all()
        self.unlock()  # (a later stack in this process may take the run dir)
