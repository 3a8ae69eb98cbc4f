"""A service told to stop (SIGTERM: what docker, systemd and `timeout` send) before its NATS ever answered stops
at once with status 0: the first connection is retried for ever (the hub may come up later), and nats-py
retries inside its own `connect`, which is cut short by the stop. Real processes; NATS is a closed port."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cleave.api.natsconf import free_port

pytestmark = pytest.mark.timeout(120)
TRIES_LOGGED_S = 60.0  # until the service has logged that it cannot reach NATS
STOPPED_WITHIN_S = 10.0  # a stop before connecting waits for nothing: no drain, no commit


@pytest.mark.parametrize("service", ["worker", "scheduler", "ps"])
def test_a_service_that_cannot_reach_nats_stops_at_once_on_sigterm(service: str, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('preset = "tiny"\nsteps = 2\n')
    argv = [sys.executable, "-m", "cleave_cli", service, "--nats", f"nats://127.0.0.1:{free_port()}",
            *(["--job", str(job)] if service == "ps" else [])]
    log = tmp_path / "service.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TRIES_LOGGED_S
        while "nats_error" not in log.read_text(errors="replace"):  # it is retrying
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STOPPED_WITHIN_S) == 0, log.read_text(errors="replace")[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_worker_whose_nats_went_away_stops_cleanly_on_sigterm(nats_server, tmp_path: Path) -> None:
    """A worker stopped while its connection was reconnecting (its site's leaf node down or revoked) exited 1
    with two tracebacks: the connection could not drain, and its close raised too. A `cleave swarm` behind it
    ended with an ExceptionGroup and exit codes [1, 1]."""
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cleave_cli", "worker", "--nats", nats_server.url,
                                 "--worker-id", "w1", "--profile", "flops=5e8,down=1e9,up=1e9,latency=0,memory=4Gi"],
                                stdout=out, stderr=subprocess.STDOUT)  # (declared: nothing to measure first)
    try:
        deadline = time.monotonic() + TRIES_LOGGED_S
        while "worker_started" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.05)
        nats_server.stop()
        while "nats_disconnected" not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.05)
        time.sleep(2)  # (reconnecting)
        proc.send_signal(signal.SIGTERM)
        said = log.read_text(errors="replace")
        assert proc.wait(timeout=STOPPED_WITHIN_S) == 0, log.read_text(errors="replace")[-3000:]
        assert "Traceback" not in log.read_text(errors="replace")[len(said):]
        assert "worker_stopped" in log.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_worker_measuring_its_links_stops_at_once_on_sigterm(nats_server, tmp_path: Path) -> None:
    """A worker stopped while it measured its links (no scheduler answering its probes: none up yet, or its
    server gone) waited for the measurement's probes to time out: 13 s."""
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cleave_cli", "worker", "--nats", nats_server.url,
                                 "--worker-id", "w1"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TRIES_LOGGED_S
        while "links_not_measured" not in log.read_text(errors="replace"):  # probing, no scheduler answers
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.05)
        nats_server.stop()
        time.sleep(1)  # (a probe in flight against a server gone)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STOPPED_WITHIN_S + 20) == 0, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() - stopped < STOPPED_WITHIN_S / 2, log.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
