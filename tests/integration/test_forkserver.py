"""The local stack's fork server (cleave.api.forkserver): each service is a fork that is the service as
`python -m cleave_cli ...` would run it, with a real nats-server and the stack's own code.

- A forked service has the fork server for its parent, `ps` shows its own command line, its environment is the
  one the stack gave it (a worker told CLEAVE_WORKER_THREADS=0 refuses it, in its log, with status 2), and
  its end is seen as Popen's would be: its exit status, or minus the signal that killed it, after which the
  supervisor starts it again as a fork.
- A service whose environment changes what an interpreter reads as it starts (OMP_NUM_THREADS) is a process of
  its own, as is every service with CLEAVE_FORK_SERVER=0.
- A fork leaves with `os._exit` (the interpreter's teardown of the preloaded modules skipped), yet ends as an
  interpreter would: its threads finished, its exit functions run, its output flushed, its status as given.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from cleave.api.forks import Forked
from cleave.api.stack import Stack

TIMEOUT_S = 120.0


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def wait_for(cond, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + TIMEOUT_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture
def stack(tmp_path: Path, nats_url: str):  # noqa: ANN201
    s = Stack(tmp_path)
    s.nats_url = nats_url
    yield s
    s.stop_all(grace_s=10)


def test_a_service_is_a_fork_that_is_the_service(stack: Stack) -> None:
    sched = stack.service("scheduler", "scheduler")
    assert isinstance(sched.popen, Forked)
    server = stack._forks.proc.pid
    assert parent_of(sched.popen.pid) == server
    wait_for(lambda: cmdline(sched.popen.pid) == " ".join(sched.argv), "its command line in `ps`")
    wait_for(lambda: "scheduler_started" in stack.log_path("scheduler").read_text(), "the scheduler's log")

    bad = stack.service("worker-1", "worker", ["--worker-id", "w1"], env={"CLEAVE_WORKER_THREADS": "0"},
                        restart=False)
    assert isinstance(bad.popen, Forked) and bad.popen.wait(TIMEOUT_S) == 2
    assert "threads" in stack.last_words(bad).lower(), stack.last_words(bad)

    first = sched.popen.pid
    os.kill(first, signal.SIGKILL)
    assert sched.popen.wait(TIMEOUT_S) == -signal.SIGKILL
    stack.supervise()  # started again, a fork again
    assert sched.running() and sched.popen.pid != first and parent_of(sched.popen.pid) == server


def test_a_service_whose_interpreter_would_start_otherwise_is_a_process_of_its_own(
        stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = stack.service("scheduler", "scheduler", env={"OMP_NUM_THREADS": "1"})
    assert not isinstance(threads.popen, Forked) and parent_of(threads.popen.pid) == os.getpid()
    monkeypatch.setenv("CLEAVE_FORK_SERVER", "0")
    own = stack.service("scheduler-2", "scheduler")
    assert not isinstance(own.popen, Forked) and parent_of(own.popen.pid) == os.getpid()
    wait_for(lambda: "scheduler_started" in stack.log_path("scheduler-2").read_text(), "the scheduler's log")


def test_a_fork_server_that_dies_takes_its_services_and_they_are_started_again(stack: Stack) -> None:
    """Its services die with it (their parent-death signal: nothing is left behind), the stack sees them end
    killed, and its supervision starts them again, from a new fork server."""
    sched = stack.service("scheduler", "scheduler")
    wait_for(lambda: "scheduler_started" in stack.log_path("scheduler").read_text(), "the scheduler's log")
    old_server, old = stack._forks.proc.pid, sched.popen.pid
    os.kill(old_server, signal.SIGKILL)
    assert sched.popen.wait(TIMEOUT_S) == -signal.SIGKILL
    wait_for(lambda: not Path(f"/proc/{old}").exists() or "Z" in Path(f"/proc/{old}/stat").read_text().split()[2],
             "the service to die with its fork server")
    stack.supervise()
    assert sched.running() and isinstance(sched.popen, Forked)
    assert stack._forks.proc.pid != old_server and parent_of(sched.popen.pid) == stack._forks.proc.pid
    wait_for(lambda: stack.log_path("scheduler").read_text().count("scheduler_started") == 2, "its second start")


SERVICE = """import atexit, sys, threading, time
from cleave_cli.forkserver import end
def service():
    threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', end=' '))).start()
    atexit.register(lambda: print('exit functions run', end=' '))
    print('unflushed', end=' ')
    {how}
end(service)
"""


@pytest.mark.parametrize(("how", "status", "err"), [
    ("return 3", 3, ""), ("return None", 0, ""), ("sys.exit('refused: a bad knob')", 1, "refused: a bad knob"),
    ("raise ValueError('a fault')", 1, "ValueError: a fault"), ("raise KeyboardInterrupt", -signal.SIGINT, "")])
def test_a_fork_ends_as_an_interpreter_would(how: str, status: int, err: str) -> None:
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    done = subprocess.run([sys.executable, "-c", SERVICE.format(how=how)], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == status and done.stdout == "unflushed thread done exit functions run ", done
    assert err in done.stderr, done.stderr
