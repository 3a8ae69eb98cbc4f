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
