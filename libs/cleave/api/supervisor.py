"""The local supervisor's signal contract: it never leaves its stack behind.

- SIGINT, SIGTERM and SIGHUP (Ctrl-C, `timeout`/systemd/a process manager, a closing terminal) raise
  `Stopped` in the supervisor's main thread, so the command's `finally` stops the stack in order
  (services, then nats-server) under its grace period. A second signal while stopping exits at once.
- Every child is started with a parent-death signal (Linux `PR_SET_PDEATHSIG`): if the supervisor dies
  without stopping them (SIGKILL, OOM killer, a crash), the kernel signals each child. nats-server gets
  SIGTERM, so it closes its JetStream store cleanly; services get SIGKILL (JetStream keeps what they
  committed, exactly as after a crash). Children run in their own session, so a terminal's Ctrl-C reaches
  only the supervisor, which then stops them in order.
- Within `signals_held()` (the stack's own bookkeeping of its processes: starting, polling, signalling and
  reaping them) a stop signal is raised only as the block ends. Raised anywhere, it could land between
  `subprocess.Popen`'s taking of its wait lock and the `try` that gives it back; the lock stayed taken, and
  the supervisor's stop then waited on it for ever.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from cleave.errors import Stopped

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# the process's stop signals (handlers are process-wide): the first one's number, how deep the main thread is
# in signals_held blocks, and a signal that arrived within them (raised as the outermost one ends)
_stop = {"signum": 0, "held": 0, "pending": 0}
HELD_DOWN_DIR = "held-down"  # <run_dir>/held-down/<name>: the supervisor does not restart <name> (cleave chaos)


def held_down(run_dir: Path, name: str) -> bool:
    return (run_dir / HELD_DOWN_DIR / name).exists()


def parent_death_signal(sig: int) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child receive `sig` when this process dies; None off Linux.

    Linux sends it when the *thread* that forked the child exits: spawn from the main thread (the stack
    does) or from a thread that lives as long as the stack.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent, sig = os.getpid(), int(sig)

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:  # the supervisor died between fork and prctl
            os._exit(126)

    return preexec


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Within this block, a stop signal says so on stderr and raises `Stopped` (at once, or as a `signals_held`
    block ends); a second one exits at once with 128+signal."""

    def on_signal(signum: int, _frame: object) -> None:
        if _stop["signum"]:
            os._exit(128 + signum)  # the children still die: they carry the parent-death signal
        _stop["signum"] = signum
        with contextlib.suppress(OSError):  # (a raw write: the main thread may be inside a write to stderr)
            os.write(2, f"cleave: stopping on {signal.Signals(signum).name}; a second signal exits at once\n".encode())
        if _stop["held"]:
            _stop["pending"] = signum
            return
        raise Stopped(signum)

    _stop.update(signum=0, pending=0)
    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """A block that a stop signal does not interrupt: it raises `Stopped` as the block ends instead. For the
    main thread's dealings with `subprocess.Popen` (its locks); on other threads (which never receive a
    signal) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _stop["held"] += 1
    try:
        yield
    finally:
        _stop["held"] -= 1
        if not _stop["held"] and _stop["pending"]:
            signum, _stop["pending"] = _stop["pending"], 0
            raise Stopped(signum)
