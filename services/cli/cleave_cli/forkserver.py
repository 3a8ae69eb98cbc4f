"""The local stack's fork server: what every service imports (torch, nats-py, Cleave's services: 2-3 s of CPU a
process) is imported once, here, and each service is a fork of this process.

`python -m cleave_cli.forkserver` (started by `cleave.api.forks.ForkServer`; the stacks of one program thread
share one, `cleave.api.forks.shared`): requests come on stdin, one JSON line each, `{"argv": [...], "env":
{...}, "cwd": ..., "log": PATH, "orphaned": SIGNAL}` (a pipe between two processes of one machine, not a bus
message); for each, a child is forked that becomes the service exactly as `python -m cleave_cli ...` would (its
own session, its environment and working directory, stdout and stderr appended to PATH, stdin from /dev/null,
`ps` shows its command line, its parent-death signal `orphaned`), and the answer on stdout is `{"pid": N}`. When a child ends, `{"pid": N,
"status": S}` follows (S as `subprocess.Popen.returncode`: negative for a signal). The server ends when its
stdin closes (its children receive their parent-death signal then, as they would if the stack died), or once it
has had no child for IDLE_EXIT_S.

A fork ends as multiprocessing ends its children (`end`): once its service returns, its threads are joined, its
exit functions run and its output flushed, and then it leaves with `os._exit`, skipping the interpreter's
teardown of every module the server preloaded (0.25-0.3 s of CPU a service here, torch's the most).

The server never runs a torch operation nor starts a thread, so a fork inherits no thread pool. What a fresh
interpreter reads from its environment before any code runs (`PYTHON*`, the libraries' thread settings)
cannot change in a fork: the stack forks only children whose environment agrees with the server's on those
(`cleave.api.forks.interpreter_env`), and starts any other as a process of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

from setproctitle import getproctitle, setproctitle

from cleave.api.forks import IDLE_EXIT_S
from cleave.api.supervisor import parent_death_signal

PRELOAD = ("cleave_cli.main", "cleave_ps.main", "cleave_worker.main", "cleave_scheduler.main", "cleave_monitor.main")


def serve(requests: int, answers: int) -> tuple[dict, Callable[[], None]] | None:
    """Fork a child for each request read from fd `requests`, answering on fd `answers`; returns None when
    `requests` closes or after IDLE_EXIT_S without a child, and, in each child, its request and what sets its
    parent-death signal (the child goes on to become the service)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (a handler, so that a child's end wakes the select)
    pending, children = b"", set()
    while True:
        ready, _, _ = select.select([requests, wake_r], [], [], None if children else IDLE_EXIT_S)
        if not ready and not children:
            return None
        if wake_r in ready:
            os.read(wake_r, 4096)
        children -= reap(answers)
        if requests not in ready:
            continue
        chunk = os.read(requests, 1 << 20)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            req = json.loads(line)
            orphaned = parent_death_signal(int(req["orphaned"]))  # (made here: it checks its parent is this one)
            pid = os.fork()
            if pid == 0:
                for fd in (requests, answers, wake_r, wake_w):
                    os.close(fd)
                return req, orphaned
            children.add(pid)
            os.write(answers, json.dumps({"pid": pid}).encode() + b"\n")


def status_of(wait_status: int) -> int:
    """A wait status as `subprocess.Popen.returncode` gives it: the exit code, or minus the signal."""
    return -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


def reap(answers: int) -> set[int]:
    """Tell the end of every child that has ended; returns their pids."""
    ended = set()
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.add(pid)
        os.write(answers, json.dumps({"pid": pid, "status": status_of(wait_status)}).encode() + b"\n")


def become(req: dict, orphaned: Callable[[], None] | None) -> list[str]:
    """In a fresh fork: take on the service's session, parent-death signal, files, environment and name; returns
    the arguments for `cleave_cli.main.main`."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    if orphaned is not None:
        orphaned()  # (exits 126 where the server, and so the stack, died since the fork)
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    argv = req["argv"]
    setproctitle(" ".join(argv))  # (before the environment changes: the title's room is found through it)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.argv = [argv[2] if argv[1:2] == ["-m"] else argv[0], *argv[3:]]
    return argv[3:]


def main() -> NoReturn:
    requests, answers = os.dup(0), os.dup(1)  # (fds 0 and 1 are the children's: /dev/null, their log)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)
    os.close(null)
    for name in PRELOAD:  # (a module that does not import here is imported by the service that needs it)
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001, S112
            continue
    setproctitle(getproctitle())  # (its room in memory found now, from the environment the server started with)
    gc.freeze()  # what the imports made is shared with every child: a collection there leaves its pages alone
    child = serve(requests, answers)
    if child is None:  # (at once: an interpreter's orderly end with torch loaded is half a second of CPU)
        os._exit(0)
    from cleave_cli.main import main as cleave  # noqa: PLC0415 - (imported above, or by the service that needs it)

    argv = become(*child)
    end(lambda: cleave(argv))


def end(service: Callable[[], object]) -> NoReturn:
    """Run `service` and end this process with its exit status, as the interpreter would (non-daemon threads
    joined, then the atexit functions, an uncaught exception printed, a Ctrl-C death by SIGINT), but without its
    teardown of every loaded module: `os._exit`, as multiprocessing ends a forked child."""
    try:
        code = _status(service())
    except SystemExit as e:
        code = _status(e.code)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - what the interpreter does with an exception nobody caught
        traceback.print_exc()
        code = 1
    threading._shutdown()  # noqa: SLF001 - the interpreter's own first step at exit (multiprocessing's too)
    atexit._run_exitfuncs()  # noqa: SLF001 - its second (logging's shutdown, weakref finalizers, ...)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _status(code: object) -> int:
    """An exit status as SystemExit's argument gives it (None: 0; an int; anything else printed, and 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
