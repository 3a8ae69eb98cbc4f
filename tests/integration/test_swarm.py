"""`cleave swarm`: 20 real workers in 2 processes join a real stack, train a tiny job equal to the reference,
show up in nats-server's /connz under role names, and stop cleanly on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cleave import bus as busmod
from cleave.api.fleet import LocalFleet, run_reference
from cleave.api.natsconf import free_port, nats_server_binary
from cleave.train.job import JobConfig
from tests.integration.fleet import assert_same
from tests.integration.test_scheduler import next_plan

WORKERS, PROCESSES = 20, 2
READY_TIMEOUT_S = 20.0


@pytest.fixture
def nats_with_monitor(tmp_path: Path):
    """A nats-server with JetStream and its HTTP monitoring port (for /connz); yields (url, monitor url)."""
    port, mport, log = free_port(), free_port(), tmp_path / "nats.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-m", str(mport),
                                 "-js", "-sd", str(tmp_path / "js")], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while "Server is ready" not in log.read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
        time.sleep(0.02)
    try:
        yield f"nats://127.0.0.1:{port}", f"http://127.0.0.1:{mport}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def connection_names(monitor: str, state: str) -> list[str]:
    with urllib.request.urlopen(f"{monitor}/connz?state={state}&limit=1000", timeout=5) as r:
        return [c.get("name", "") for c in json.load(r)["connections"]]


@pytest.mark.slow  # ~14 s; benchmarks/fleet_scale.py runs 10 to 1,000 workers
async def test_a_swarm_of_20_workers_trains_equal_to_the_reference(tmp_path, nats_with_monitor):
    nats_url, monitor = nats_with_monitor
    job = JobConfig(preset="tiny", steps=3, job_id="swarm-test")
    fleet = LocalFleet(tmp_path / "run", 0, nats_url=nats_url)
    bus = await busmod.connect(nats_url, "test")
    try:
        fleet.start()
        swarm = fleet.stack.spawn("swarm", "worker", [sys.executable, "-m", "cleave_cli", "swarm", "--workers",
                                                      str(WORKERS), "--processes", str(PROCESSES), "--nats", nats_url],
                                  restart=False)
        await bus.setup()
        plan = await next_plan(bus, 0, timeout_s=60)
        while len(plan.workers) < WORKERS:
            plan = await next_plan(bus, plan.version, timeout_s=60)
        ids = {f"swarm-{p}-{i}" for p in range(PROCESSES) for i in range(WORKERS // PROCESSES)}
        assert set(plan.workers.ids) == ids

        metrics = tmp_path / "metrics.jsonl"
        fleet.start_ps(job, metrics)
        got = [m["loss"] for m in fleet.wait_ps(metrics, timeout_s=240)]
        want = [m["loss"] for m in run_reference(job, tmp_path / "ref.jsonl")]
        assert_same(got, want)

        names = set(connection_names(monitor, "any"))
        assert {"cleave-scheduler", f"cleave-ps-{job.job_id}"} <= names
        assert {f"cleave-worker-{w}" for w in plan.workers.ids} <= names

        swarm.popen.send_signal(signal.SIGTERM)  # every instance and process stops cleanly
        assert swarm.popen.wait(timeout=30) == 0
        assert not [n for n in connection_names(monitor, "open") if n.startswith("cleave-worker-swarm")]
    finally:
        await bus.close()
        fleet.stop()
