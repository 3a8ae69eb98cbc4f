"""`cleave chaos` against a real local stack: it reads stack.json, and the supervisor brings victims back."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from cleave.api.fleet import LocalFleet
from cleave_cli import chaos_cmd


def chaos(run_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cleave_cli", "chaos", *args, "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=60)


def pids(run_dir) -> dict[str, int]:
    doc = json.loads((run_dir / "stack.json").read_text())
    return {p["name"]: p["pid"] for p in doc["processes"]}


def test_kill_freeze_thaw_and_restart_roles(tmp_path):
    fleet = LocalFleet(tmp_path, workers=2)
    try:
        fleet.start()
        before = pids(tmp_path)
        out = chaos(tmp_path, "kill", "--name", "worker-2")
        assert out.returncode == 0 and "kill worker-2" in out.stdout, out.stderr
        fleet.stack.procs["worker-2"].popen.wait(timeout=10)
        fleet.stack.supervise()
        after = pids(tmp_path)
        assert after["worker-2"] != before["worker-2"] and after["worker-1"] == before["worker-1"]

        out = chaos(tmp_path, "freeze", "--role", "scheduler", "--thaw-after", "0.2")
        assert out.returncode == 0 and "thaw scheduler" in out.stdout
        assert fleet.stack.procs["scheduler"].popen.poll() is None  # thawed, still running

        out = chaos(tmp_path, "restart", "--role", "nats")
        assert out.returncode == 0
        fleet.stack.procs["nats"].popen.wait(timeout=10)
        fleet.stack.supervise()  # back on the same port and store
        assert fleet.stack.procs["nats"].restarts == 1 and fleet.stack.procs["nats"].popen.poll() is None

        out = chaos(tmp_path, "kill", "--name", "nope")
        assert out.returncode == 2 and "no running process" in out.stderr
    finally:
        fleet.stop()


def test_kill_no_restart_leaves_the_victim_dead_and_imports_no_torch(tmp_path):
    """`--no-restart` marks the victim before the signal and the supervisor leaves it down; the command
    imports neither torch nor a model (it is fast to start) and stamps the time to the millisecond."""
    fleet = LocalFleet(tmp_path, workers=2)
    try:
        fleet.start()
        probe = ("import sys; from cleave_cli.main import main; "
                 f"code = main(['chaos', 'kill', '--name', 'worker-1', '--no-restart', '--run-dir', {str(tmp_path)!r}]); "
                 "print('torch' in sys.modules, code)")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[-1] == "False 0"
        stamp = out.stdout.split()[0]  # HH:MM:SS.mmm
        assert len(stamp) == 12 and stamp[8] == "." and stamp[9:].isdigit(), out.stdout
        fleet.stack.procs["worker-1"].popen.wait(timeout=10)
        ended = [p.name for p in fleet.stack.supervise()]
        assert "worker-1" in ended and fleet.stack.procs["worker-1"].restarts == 0
        assert fleet.stack.procs["worker-2"].popen.poll() is None
        assert chaos(tmp_path, "freeze", "--name", "worker-2", "--no-restart").returncode == 2  # kill only
    finally:
        fleet.stop()


def test_a_stale_stack_json_kills_nothing_else(tmp_path):
    """A stack whose supervisor was killed (SIGKILL) left stack.json saying its processes run: their pids, taken
    by other programs since, were signalled. A pid counts only while its process started when stack.json says."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        entry = {"name": "worker-1", "role": "worker", "pid": other.pid, "restarts": 0, "running": True}
        for started_at, code in ((time.time() - 3600, 2), (None, 0)):
            at = started_at if started_at is not None else chaos_cmd.started(other.pid)
            (tmp_path / "stack.json").write_text(json.dumps({"processes": [{**entry, "started_at": at}]}))
            done = chaos(tmp_path, "freeze", "--name", "worker-1")
            assert done.returncode == code, done.stderr
            if code:
                assert "no running process matches 'worker-1'" in done.stderr and other.poll() is None
                assert "1 it says run are gone or their pids are other programs' now" in done.stderr
        chaos(tmp_path, "thaw", "--name", "worker-1")
    finally:
        other.kill()
        other.wait()


def test_the_ps_of_a_hubs_job_is_found_where_the_runner_keeps_it(tmp_path):
    """`cleave up`'s stack has no PS of its own: its runner starts each job's PS in <run dir>/runner. Asked for
    the PS of the hub's stack, the command says where they are; `runner` is a role."""
    (tmp_path / "runner").mkdir()
    for path in (tmp_path / "stack.json", tmp_path / "runner" / "stack.json"):
        path.write_text(json.dumps({"processes": []}))
    out = chaos(tmp_path, "kill", "--role", "ps")
    assert out.returncode == 2 and f"a hub's jobs run their PSs in --run-dir {tmp_path / 'runner'}" in out.stderr
    assert "runner" in chaos_cmd.ROLES
