"""The local supervisor (`cleave up`, `cleave train`) never leaves its stack behind.

Each stop signal, and SIGKILL of the supervisor itself, ends with no process of the stack running; the
JetStream store then opens again with every stream intact (and the PS's last checkpoint matching its
SHA-256). The stack's nats-server serves its HTTP monitoring port (`/varz`, `/connz`) on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from cleave.api.stack import CRASH_LOOP_STARTS, Stack
from cleave.api.state import read_state, state_server
from cleave.api.supervisor import signals_held, stop_signals
from cleave.errors import CleaveError, Stopped

READY_TIMEOUT_S = 120.0  # the monitor and the workers import torch first; the machine may be loaded
GONE_TIMEOUT_S = 30.0


class Supervisor:
    """`cleave ARGS` as a child of the test, its output read line by line on a thread."""

    def __init__(self, *args: str) -> None:
        # PYTHONFAULTHANDLER: on SIGABRT it prints where each of its threads was (`end` on a timeout)
        self.proc = subprocess.Popen([sys.executable, "-m", "cleave_cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.out: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_line(self, needle: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait for an output line containing `needle`."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.out.append(line)
            if needle in line:
                return
        raise AssertionError(f"no {needle!r} from the supervisor: {''.join(self.out)}")

    def end(self, timeout_s: float = 60.0) -> tuple[int, str]:
        """Wait for it to exit; returns its status and all its output. One still running after `timeout_s` is
        made to print its threads' stacks (SIGABRT) into the assertion's message."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            self.proc.wait(timeout=30)
            raise AssertionError(f"still running {timeout_s}s later; it said: {self._said()}") from None
        said = self._said()
        self.proc.stdout.close()
        return code, said

    def _said(self) -> str:
        """All its output (it has exited)."""
        self.reader.join(timeout=10)
        while (line := self.lines.get_nowait() if not self.lines.empty() else None) is not None:
            self.out.append(line)
        return "".join(self.out)

    def kill(self) -> None:
        """After a failure: SIGKILL it (its children carry the parent-death signal)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.end()


@pytest.fixture
def supervisor():
    started: list[Supervisor] = []

    def start(*args: str) -> Supervisor:
        started.append(Supervisor(*args))
        return started[-1]

    yield start
    for s in started:
        if s.proc.returncode is None:
            s.kill()


def alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stack_pids(run_dir: Path) -> dict[str, int]:
    doc = json.loads((run_dir / "stack.json").read_text())
    return {p["name"]: p["pid"] for p in doc["processes"] if p["pid"]}


def assert_all_gone(pids: dict[str, int]) -> None:
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while time.monotonic() < deadline:
        left = {n: p for n, p in pids.items() if alive(p)}
        if not left:
            return
        time.sleep(0.1)
    for pid in left.values():
        os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"left running after the supervisor ended: {left}")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - a local http:// URL
        return json.loads(r.read())


def wait_connections(monitor: str, n: int) -> None:
    """Until nats-server's /connz lists `n` client connections (each with its byte counters)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        conns = get_json(f"{monitor}/connz")["connections"] or []
        if len(conns) >= n:
            assert all("in_bytes" in c and "out_bytes" in c for c in conns), conns
            return
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} connections on {monitor}/connz: {conns}")


def streams(monitor: str) -> dict[str, int]:
    """Stream name -> last sequence, from nats-server's /jsz."""
    doc = get_json(f"{monitor}/jsz?streams=true")
    return {s["name"]: s["state"]["last_seq"] for a in doc.get("account_details", [])
            for s in a.get("stream_detail", [])}


def assert_store_reopens(run_dir: Path, before: dict[str, int]) -> None:
    """A fresh nats-server on the run's store is healthy and holds every stream, none shorter."""
    stack = Stack(run_dir)
    try:
        stack.start_nats()
        assert get_json(f"{stack.nats_monitor}/healthz?js-enabled-only=true")["status"] == "ok"
        after = streams(stack.nats_monitor)
        assert set(before) <= set(after), (before, after)
        assert all(after[s] >= seq for s, seq in before.items()), (before, after)
    finally:
        stack.stop_all()


# SIGINT and SIGHUP go to the same handler as SIGTERM (`cleave.api.supervisor.STOP_SIGNALS`): `-m slow` runs them
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow),
                                 pytest.param(signal.SIGHUP, marks=pytest.mark.slow), signal.SIGKILL],
                         ids=lambda s: signal.Signals(s).name)
def test_up_stops_its_whole_stack(tmp_path, supervisor, sig):
    run_dir = tmp_path / "run"
    up = supervisor("up", "--workers", "1", "--run-dir", str(run_dir))
    up.wait_line("stops everything")
    doc = json.loads((run_dir / "stack.json").read_text())
    monitor = doc["nats_monitor"]
    assert monitor.startswith("http://127.0.0.1:")
    assert get_json(f"{monitor}/varz")["jetstream"]["config"]["store_dir"].startswith(str(run_dir))
    wait_connections(monitor, 3)  # scheduler, worker, monitor: each its own connection
    pids = stack_pids(run_dir)
    assert {"nats", "scheduler", "worker-1", "monitor"} <= set(pids)
    before = streams(monitor)
    assert before, "the scheduler keeps its registry and plans in JetStream"

    up.proc.send_signal(sig)
    code, out = up.end()
    assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0), out
    assert_all_gone(pids)
    if sig != signal.SIGKILL:  # a clean stop: every service closed its connection without an error (a bus drain
        # that timed out, waiting on a subscription nobody read, left a traceback in the runner's log)
        assert f"cleave: stopping on {signal.Signals(sig).name}; a second signal exits at once" in out, out
        logs = {f.name: f.read_text(errors="replace") for f in (run_dir / "logs").glob("*.log")}
        assert not [name for name, text in logs.items() if "Traceback" in text], logs
    assert_store_reopens(run_dir, before)


def test_train_stopped_midway_leaves_nothing_and_a_sound_checkpoint(tmp_path, supervisor):
    run_dir = tmp_path / "run"
    train = supervisor("train", "--preset", "tiny", "--steps", "500", "--workers", "2", "--job-id", "sig",
                   "--run-dir", str(run_dir))
    train.wait_line("step 3 (")  # the progress line of a step that the PS committed
    pids = stack_pids(run_dir)
    train.proc.send_signal(signal.SIGTERM)
    code, out = train.end()
    assert code == 128 + signal.SIGTERM and "stopped by SIGTERM" in out, out
    assert out.count("cleave: stopping on SIGTERM; a second signal exits at once") == 1, out
    assert "dashboard: http://127.0.0.1:" in out and "monitor" in pids  # a local train serves its dashboard
    assert_all_gone(pids)

    async def last_checkpoint() -> int:
        with state_server(run_dir) as url:
            head, *_ = await read_state(url, "sig")  # raises unless every chunk matches its SHA-256
            return head.step

    committed = asyncio.run(last_checkpoint())
    assert 1 <= committed < 500
    # the steps committed while the stack was shut down are shown too, and the run says where it goes on (the
    # progress lines lagged the metrics file by up to 6 steps, and nothing said where the job stopped)
    assert max(int(m["step"]) for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())) \
        == committed
    assert f"step {committed} ({committed + 1}/500)" in out, out
    assert (f"job sig: steps 0-{committed} of 500 are committed ({run_dir / 'metrics.jsonl'}); the same command "
            f"resumes it from step {committed + 1}") in out, out

    # resumed: the earlier run's steps are not shown again as if new, and the summary is of this run's steps
    steps = committed + 3
    again = supervisor("train", "--preset", "tiny", "--steps", str(steps), "--workers", "2", "--job-id", "sig",
                       "--run-dir", str(run_dir))
    code, out = again.end(timeout_s=180)
    assert code == 0, out
    assert (f"job sig resumes from step {committed + 1}: steps 0-{committed} were committed by an earlier run "
            f"({run_dir / 'metrics.jsonl'})") in out, out
    shown = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in shown] == [str(s) for s in range(committed + 1, steps)], out
    assert f"over steps {committed + 1}-{steps - 1} (2 steps)" in out, out


def test_a_stopped_job_of_no_named_id_says_which_id_resumes_it(tmp_path, supervisor):
    """Stopped, a job started without --job-id said "the same command resumes it from step N": the same command
    makes a new job, which starts from step 0 (and sets the metrics file aside). It names the id to add."""
    run_dir = tmp_path / "run"
    train = supervisor("train", "--preset", "tiny", "--steps", "500", "--workers", "1", "--run-dir", str(run_dir))
    train.wait_line("step 1 (")
    train.proc.send_signal(signal.SIGTERM)
    code, out = train.end()
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    assert code == 128 + signal.SIGTERM and job_id.startswith("train-"), out
    assert re.search(rf"job {job_id}: steps 0-\d+ of 500 are committed \(.*\); the same command with --job-id "
                     rf"{job_id} resumes it from step \d+", out), out


def test_a_process_last_words_are_its_last_error_line_of_its_latest_start(tmp_path: Path) -> None:
    """`Stack.last_words`: what the runner reports for a failed PS and a local fleet for a worker that could not
    start: the last `cleave: error:` line, else the last line, of what the process said since it was last started."""
    stack = Stack(tmp_path)
    said = "import sys; print('cleave: error: first start'); print('cleave: error: ' + sys.argv[1]); print('bye')"
    proc = stack.spawn("talker", "tool", [sys.executable, "-c", said, "bad knob"], restart=False)
    proc.popen.wait(60)
    assert stack.last_words(proc) == "bad knob"
    proc.argv = [sys.executable, "-c", "print('only this')"]
    stack.restart("talker")  # the earlier start's words are not this one's
    proc.popen.wait(60)
    assert stack.last_words(proc) == "only this"
    assert stack.log_path("talker").read_text().count("bad knob") == 1


def test_a_worker_that_refuses_its_settings_stays_down_and_is_told_once(tmp_path: Path) -> None:
    """A worker that exits with a settings error (status 2) would only refuse them again: `supervise` leaves it
    down (a crashed worker it restarts), and `tell_ended` gives the long-running stack's terminal one line with
    its status and its own error."""
    stack = Stack(tmp_path)
    bad = stack.service("worker-1", "worker", ["--worker-id", "no.dots"])
    crash = stack.spawn("worker-2", "worker", [sys.executable, "-c", "import sys; sys.exit(1)"])
    bad.popen.wait(READY_TIMEOUT_S)
    crash.popen.wait(60)
    try:
        ended = stack.supervise()
        assert [p.name for p in ended] == ["worker-1"] and bad.restarts == 0 and crash.restarts == 1
        (line,) = stack.tell_ended(ended)
        assert line.startswith("worker-1 stopped with status 2, not restarted: ") and "worker_id" in line, line
        assert stack.tell_ended(stack.supervise()) == []  # said once
        (tmp_path / "held-down").mkdir()
        (tmp_path / "held-down" / "worker-2").touch()  # as `cleave chaos kill --no-restart` leaves it
        crash.popen.wait(60)
        assert stack.tell_ended(stack.supervise()) == ["worker-2 stopped with status 1, not restarted: held down "
                                                       "(`cleave chaos ... --no-restart`)"]
        said = {p["name"]: p["running"] for p in json.loads((tmp_path / "stack.json").read_text())["processes"]}
        assert said == {"worker-1": False, "worker-2": False}  # (it said both ran: chaos blamed the supervisor)
        again = Stack(tmp_path).spawn("worker-2", "worker", [sys.executable, "-c", "import sys; sys.exit(1)"])
        assert not (tmp_path / "held-down" / "worker-2").exists()  # a new process of that name: the hold is gone
        again.popen.wait(60)
    finally:
        stack.stop_all()


def test_a_crash_loop_is_left_down_and_told_but_a_killed_process_always_comes_back(tmp_path: Path) -> None:
    """A service that fails right after every start (a bug, a broken install) is left down after
    CRASH_LOOP_STARTS failures in a row, with its words, instead of being restarted for ever behind a quiet
    terminal; one killed by a signal (a drill, `cleave chaos kill`) is restarted however often it happens."""
    stack = Stack(tmp_path)
    crash = stack.spawn("worker-1", "worker", [sys.executable, "-c", "print('boom'); raise SystemExit(1)"])
    sleeper = stack.spawn("worker-2", "worker", ["sleep", "600"])
    try:
        deadline = time.monotonic() + 120
        ended: list = []
        while not ended and time.monotonic() < deadline:
            ended = stack.supervise()
            time.sleep(0.05)
        assert [p.name for p in ended] == ["worker-1"] and crash.restarts == CRASH_LOOP_STARTS - 1
        assert stack.tell_ended(ended) == [f"worker-1 stopped with status 1, not restarted: it failed "
                                           f"{CRASH_LOOP_STARTS} times in a row, each within 60 s of starting; boom "
                                           f"(see {stack.log_path('worker-1')})"]
        for _ in range(CRASH_LOOP_STARTS + 1):
            stack.kill("worker-2")
            assert stack.supervise() == [crash]
        assert sleeper.restarts == CRASH_LOOP_STARTS + 1 and sleeper.running()
    finally:
        stack.stop_all()


def test_a_process_killed_and_left_down_is_told_killed_not_by_its_last_log_line(tmp_path: Path) -> None:
    """`cleave demo` kills worker-1 on purpose and does not restart it; the terminal then read `worker-1 stopped
    with status -9, not restarted: ... [info] worker_started ...`, its last log line given as the reason."""
    stack = Stack(tmp_path)
    victim = stack.spawn("worker-1", "worker", [sys.executable, "-c", "print('worker_started', flush=True); "
                                                "import time; time.sleep(600)"], restart=False)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "worker_started" not in stack.last_words(victim) and time.monotonic() < deadline:
            time.sleep(0.05)
        stack.kill("worker-1")
        assert stack.tell_ended(stack.supervise()) == [
            f"worker-1 stopped with status -9, not restarted: killed by SIGKILL (see {stack.log_path('worker-1')})"]
    finally:
        stack.stop_all()


class SignalledOnAcquire:
    """A `subprocess.Popen` wait lock that receives SIGTERM just as it is taken: the moment, between
    `Popen.poll`'s taking of the lock and the `try` that gives it back, at which a stop signal raised at once
    left the lock taken for ever (and the supervisor's stop then waited on it for ever)."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock

    def acquire(self, *args) -> bool:
        got = self.lock.acquire(*args)
        signal.raise_signal(signal.SIGTERM)  # handled as this call returns
        return got

    def release(self) -> None:
        self.lock.release()


def test_a_stop_signal_that_arrives_while_the_stack_polls_a_process_is_raised_once_the_poll_is_done(
        tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    sleeper = stack.spawn("sleeper", "tool", ["sleep", "600"], restart=False)
    lock = sleeper.popen._waitpid_lock
    sleeper.popen._waitpid_lock = SignalledOnAcquire(lock)
    try:
        with pytest.raises(Stopped), stop_signals():
            sleeper.poll()
    finally:
        sleeper.popen._waitpid_lock = lock
    assert not lock.locked()
    stack.stop_all(grace_s=5)
    assert sleeper.poll() == -signal.SIGTERM


def test_a_stop_signal_within_signals_held_is_raised_as_the_block_ends() -> None:
    done = []
    with pytest.raises(Stopped) as stopped, stop_signals():
        with signals_held():
            signal.raise_signal(signal.SIGINT)
            time.sleep(0.01)  # (a sleep is where an unheld signal is raised)
            done.append("the block's end")
        done.append("after the block")
    assert done == ["the block's end"] and stopped.value.signum == signal.SIGINT


def test_a_nats_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    """Its reason was only in its log ("nats-server exited with 1; see ..."): a port in use, a key that does not
    match its certificate. The error now carries nats-server's own line."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    stack = Stack(tmp_path)
    stack._nats_port = taken.getsockname()[1]
    try:
        with pytest.raises(CleaveError, match=r"nats-server exited with 1: Error listening on port: .*address already "
                                              r"in use.* \(see .*nats.log\)"):
            stack.start_nats()
    finally:
        stack.stop_all()
        taken.close()


def test_a_second_stack_on_a_run_dir_in_use_is_refused_and_the_first_runs_on(tmp_path, supervisor):
    """A second `cleave train` of a job while the first ran started a second nats-server on the same JetStream
    store and a second PS on the same metrics file: both trained, the stores' checkpoints became unreadable and
    the second ended with `no committed checkpoint ... reads back intact`. It is refused before it starts
    anything, status 2, and the first stack runs on untouched; so is a `--reference` run there."""
    run_dir = tmp_path / "run"
    up = supervisor("up", "--workers", "0", "--run-dir", str(run_dir))
    up.wait_line("stops everything")
    before = (run_dir / "stack.json").read_text()
    for how in ("--workers", "--reference"):  # a reference run set the metrics file aside and wrote into it
        second = subprocess.run([sys.executable, "-m", "cleave_cli", "train", "--preset", "tiny", "--steps", "1",
                                 how, *(["1"] if how == "--workers" else []), "--run-dir", str(run_dir)],
                                capture_output=True, text=True, timeout=READY_TIMEOUT_S)
        assert second.returncode == 2, second
        assert f"cleave: error: {run_dir} is in use: another cleave (pid {up.proc.pid}) runs a job there" in (
            second.stderr) and "Traceback" not in second.stderr and not second.stdout, second
    assert (run_dir / "stack.json").read_text() == before and not (run_dir / "job.json").exists()
    assert all(alive(pid) for pid in stack_pids(run_dir).values())
    up.proc.send_signal(signal.SIGTERM)
    code, out = up.end()
    assert code == 0, out


def test_two_jobs_on_one_metrics_file_at_once_the_second_is_refused(tmp_path, supervisor):
    """Two jobs given one --metrics-out at once (a reference run started beside the fleet's, both into a.jsonl):
    the second set the first's lines aside and both wrote into the new file, 148 lines of two jobs for 120
    steps, and the second said the job had already run 79 steps. The second is refused, status 2."""
    shared = tmp_path / "a.jsonl"
    first = supervisor("train", "--preset", "tiny", "--steps", "500", "--workers", "1", "--run-dir",
                       str(tmp_path / "first"), "--metrics-out", str(shared))
    first.wait_line("step 0 (")
    second = subprocess.run([sys.executable, "-m", "cleave_cli", "train", "--preset", "tiny", "--steps", "2",
                             "--reference", "--run-dir", str(tmp_path / "second"), "--metrics-out", str(shared)],
                            capture_output=True, text=True, timeout=READY_TIMEOUT_S)
    assert second.returncode == 2 and not second.stdout, second
    assert f"cleave: error: metrics file {shared} (--metrics-out) is in use: another cleave (pid {first.proc.pid}) " \
           "writes its job's steps there" in second.stderr, second
    assert not list(tmp_path.glob("a.before-*"))  # the first job's lines were not set aside
    first.proc.send_signal(signal.SIGTERM)
    code, out = first.end()
    assert code == 128 + signal.SIGTERM, out
    steps = [json.loads(line)["step"] for line in shared.read_text().splitlines()]
    assert steps == list(range(len(steps))), steps  # one job's steps, each once


def test_a_job_on_a_stack_with_no_worker_says_it_waits_for_one(tmp_path, supervisor):
    """`cleave train --nats URL` on a stack with no worker showed its `stack:` line and then nothing, for ever:
    only the PS's log said `waiting_for_workers`. The terminal is told once, with where workers come from."""
    up = supervisor("up", "--workers", "0", "--run-dir", str(tmp_path / "hub"))
    up.wait_line("stops everything")
    url = json.loads((tmp_path / "hub" / "stack.json").read_text())["nats_url"]
    train = supervisor("train", "--preset", "tiny", "--steps", "2", "--nats", url, "--run-dir", str(tmp_path / "job"))
    train.wait_line(f"cleave: the parameter server has no worker to deal to and waits for one: start some on {url}")
    train.proc.send_signal(signal.SIGTERM)
    code, out = train.end()
    assert code == 128 + signal.SIGTERM and out.count("has no worker to deal to") == 1, out
    up.proc.send_signal(signal.SIGTERM)
    assert up.end()[0] == 0
