"""`cleave chaos` against a real local stack: it reads stack.json, and the supervisor brings victims back."""

from __future__ import annotations

import json
import subprocess
import sys

from cleave_cli.jobrun import LocalFleet


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
