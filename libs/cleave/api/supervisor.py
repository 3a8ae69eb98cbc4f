"""The local supervisor's signal contract: it never leaves its stack behind.

- SIGINT, SIGTERM and SIGHUP (Ctrl-C, `timeout`/systemd/a process manager, a closing terminal) raise
  `Stopped` in the supervisor's main thread, so the command's `finally` stops the stack in order
  (services, then nats-server) under its grace period. A second signal while stopping exits at once.
- Every child is started with a parent-death signal (Linux `PR_SET_PDEATHSIG`): if the supervisor dies
  without stopping them (SIGKILL, OOM killer, a crash), the kernel signals each child. nats-server gets
  SIGTERM, so it closes its JetStream store cleanly; services get SIGKILL (JetStream keeps what they
  committed, exactly as after a crash). Children run in their own session, so a terminal's Ctrl-C reaches
  only the supervisor, which then stops them in order.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from cleave.errors import Stopped

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>



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
    """Within this block, a stop signal raises `Stopped`; a second one exits at once with 128+signal."""
    stopping = {"signum": 0}

    def on_signal(signum: int, _frame: object) -> None:
        if stopping["signum"]:
            os._exit(128 + signum)  # the children still die: they carry the parent-death signal
        stopping["signum"] = signum
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
