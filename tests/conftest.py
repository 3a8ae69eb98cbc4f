"""Shared fixtures: a real nats-server with JetStream on a free port and a temporary store."""

from __future__ import annotations

import compileall
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cleave.api.natsconf import free_port, nats_server_binary

READY_TIMEOUT_S = 20.0
ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Our sources byte-compiled once (only those changed since): the tests start hundreds of service processes,
    and where PYTHONDONTWRITEBYTECODE is set (CI images often set it) each would compile the ~180 modules it
    imports again, 0.4 s of CPU a process."""
    for folder in ("libs", "services"):
        compileall.compile_dir(ROOT / folder, quiet=1)


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Each test ends with the environment it began with: a command run in the test's process
    (`cleave_cli.main.main(["train", "--config", F, ...])`) sets CLEAVE_CONFIG for the services it would start,
    and a later test's services in this process read F's [ps] table (monkeypatch's delenv of a variable that is
    not set records nothing to undo)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


class NatsServer:
    """One nats-server process (`config`: a configuration file besides); `restart()` brings it back on the same
    port and store."""

    def __init__(self, store: Path, log: Path, config: Path | None = None) -> None:
        self.port, self.store, self.log, self.config = free_port(), store, log, config
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [nats_server_binary(), *(["-c", str(self.config)] if self.config else []), "-a", "127.0.0.1",
                 "-p", str(self.port), "-js", "-sd", str(self.store)],
                stdout=out, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "Server is ready" not in self.log.read_bytes()[offset:].decode(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nats-server did not start: {self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "jetstream", tmp_path / "nats.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url
