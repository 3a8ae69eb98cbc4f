"""The stack's side of its fork server (`cleave_cli.forkserver`, which says how it works): `ForkServer` starts
it and asks it for services; each comes back as a `Forked`, which the stack handles as a `subprocess.Popen`.
Where a fork cannot be the service as a process of its own would be (`interpreter_env`), the stack starts one.

The stacks of one program share a fork server (`shared`): one for each thread that starts services (a child's
parent-death signal follows the thread that started its parent) and each interpreter environment. A server
with no service for IDLE_EXIT_S ends; one idle for half of that is not used again, and the program's end
ends them all.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# read by the interpreter or a native library as it starts or loads, not later: a fork keeps the server's
INTERPRETER_ENV = ("PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "MALLOC_", "TORCH")
READY_TIMEOUT_S = 120.0  # the server's imports (seconds; minutes on a loaded machine) before it forks
ENABLE_ENV = "CLEAVE_FORK_SERVER"  # "0": every service a process of its own (python -m cleave_cli ...)
SERVER = "cleave_cli.forkserver"
IDLE_EXIT_S = 600.0  # a fork server with no service this long ends (a program's next stack starts another)


def interpreter_env(env: dict[str, str]) -> dict[str, str]:
    """The part of `env` a fork cannot change (PYTHONUNBUFFERED aside: the server runs unbuffered, as services)."""
    return {k: v for k, v in env.items() if k.startswith(INTERPRETER_ENV) and k != "PYTHONUNBUFFERED"}


class Forked:
    """A service forked by the server, as much of `subprocess.Popen` as the stack uses: its pid, `returncode`,
    `poll`, `wait`, `send_signal`, `terminate` and `kill` (a signal only while its end is not known, as Popen)."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.collect(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.server.collect(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The stack's fork server: started at once, it imports while the stack goes on; `spawn` waits for it."""

    def __init__(self, log: Path, preexec) -> None:  # noqa: ANN001 - a preexec_fn (cleave.api.supervisor)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.env = interpreter_env(env)
        with open(log, "ab") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", SERVER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=logf, env=env, start_new_session=True,
                                         preexec_fn=preexec)  # noqa: PLW1509
        self.log = log
        self.idle_since: float | None = time.monotonic()  # no service since then (None: it has some)
        self.children: dict[int, Forked] = {}
        self.gone = False
        self._buf = b""
        self._pids: list[int] = []  # answers to requests, in order

    def fits(self, env: dict[str, str]) -> bool:
        """Whether a service with environment `env` can be forked from here."""
        return self.usable() and interpreter_env(env) == self.env

    def usable(self) -> bool:
        """Up, and not so long idle that it may end while asked (IDLE_EXIT_S)."""
        if not self.gone and self.proc.poll() is not None:
            self.collect(0.0)  # (its end, read)
        idle = self.idle_since is not None and time.monotonic() - self.idle_since > IDLE_EXIT_S / 2
        return not self.gone and self.proc.poll() is None and not idle

    def spawn(self, argv: list[str], env: dict[str, str], log: Path, orphaned: int) -> Forked:
        req = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log), "orphaned": int(orphaned)}
        try:
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            self.collect(0.0)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._pids:
            if self.gone or time.monotonic() > deadline:
                self.close()
                raise OSError(f"the fork server did not answer (see {self.log})")
            self.collect(deadline - time.monotonic())
        child = Forked(self, self._pids.pop(0), argv)
        self.children[child.pid] = child
        self.idle_since = None
        return child

    def collect(self, timeout: float) -> None:
        """Read what the server said within `timeout` seconds: forks, and the ends of children."""
        if self.gone:
            return
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], max(0.0, timeout))[0]:
            return
        chunk = os.read(fd, 1 << 16)
        if not chunk:  # the server is gone, and with it (their parent-death signal) its children
            for child in self.children.values():
                if child.returncode is None:
                    child.returncode = -signal.SIGKILL
            self.close()
            return
        self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            said = json.loads(line)
            if "status" in said:
                child = self.children.pop(said["pid"], None)
                if child is not None:
                    child.returncode = said["status"]
                if not self.children:
                    self.idle_since = time.monotonic()
            else:
                self._pids.append(said["pid"])

    def close(self, timeout: float = 10.0) -> None:
        """End the server (its children, if any still run, receive their parent-death signal)."""
        self.gone = True
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


_shared: dict[tuple, ForkServer] = {}  # (thread, interpreter environment) -> its fork server


def shared(log: Path, preexec) -> ForkServer:  # noqa: ANN001 - a preexec_fn (cleave.api.supervisor)
    """This thread's fork server for this program's environment, started (its own log: `log`) where there is
    none that is usable."""
    key = (threading.get_ident(), tuple(sorted(interpreter_env({**os.environ, "PYTHONUNBUFFERED": "1"}).items())))
    server = _shared.get(key)
    if server is None or not server.usable():
        if server is not None and not server.gone:
            server.close()
        if not _shared:  # (the first: the program's end ends them all)
            atexit.unregister(close_all)
            atexit.register(close_all)
        server = _shared[key] = ForkServer(log, preexec)
    return server


def close_all() -> None:
    """End every fork server of this program."""
    for server in _shared.values():
        if not server.gone:
            server.close()
    _shared.clear()
