"""A real nats-server running the config `cleave auth init` wrote, and clients logged in with the credentials it
issued: shared by test_auth.py and test_auth_roles.py.

Each fixture writes a fresh config with the real `auth init` code, starts nats-server with it on a free port
and waits for its "Server is ready" line. A refusal is observed the way a service would see it: the connect
raises, or the server reports a permissions violation through `error_cb` (`Client.violation`).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import nats
import pytest

from cleave import auth, codec
from cleave.api.natsconf import free_port, nats_server_binary
from cleave.bus import receive
from cleave.schemas import DeviceProfile, Heartbeat
from cleave_cli import auth_cmd
from cleave_monitor.settings import MonitorSettings
from cleave_ps.settings import PsSettings
from cleave_scheduler.settings import SchedulerSettings
from cleave_worker.settings import WorkerSettings

READY_TIMEOUT_S = 20.0
OP_TIMEOUT_S = 5.0
SETTINGS = {"ps": PsSettings, "scheduler": SchedulerSettings, "monitor": MonitorSettings, "worker": WorkerSettings}


@dataclass
class AuthServer:
    """A nats-server running the config `cleave auth init` wrote into `out`."""

    out: Path
    port: int
    tls: bool
    proc: subprocess.Popen | None = None
    leaf_port: int = 0  # the leaf-node listener (`--sites`, `--leaf-listen`); 0: none
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    def seed(self, name: str, var: str = "") -> str:
        """The seed in `<name>.env` (its first, or the one of variable `var`)."""
        line = next(x for x in (self.out / f"{name}.env").read_text().splitlines()
                    if x.startswith(var or "CLEAVE_"))
        return line.split("=", 1)[1]

    def probe_echo(self) -> SimpleNamespace:
        """Settings of the scheduler's probe connection (`scheduler.env` holds its second seed)."""
        ca = self.out / auth_cmd.TLS_DIR / auth_cmd.CA_NAME if self.tls else None
        return SimpleNamespace(nats_url=self.url, nats_tls_ca=ca,
                               nats_nkey_seed=self.seed("scheduler", "CLEAVE_SCHEDULER_PROBE_NKEY_SEED"))

    def settings(self, role: str, name: str | None = None):
        ca = self.out / auth_cmd.TLS_DIR / auth_cmd.CA_NAME if self.tls else None
        extra = {"worker_id": name.removeprefix("worker-")} if name and name.startswith("worker-") else {}
        return SETTINGS.get(role, SimpleNamespace)(nats_url=self.url, nats_nkey_seed=self.seed(name or role),
                                                   nats_tls_ca=ca, **extra)

    def admin_seed(self) -> str:
        return (self.out / auth_cmd.ADMIN_NAME).read_text().strip()


def start_server(out: Path, log: Path, config: Path | None = None) -> subprocess.Popen:
    """nats-server with `out`'s nats.conf (or `config`), once it says it is ready (only what `log` gains counts)."""
    offset = log.stat().st_size if log.exists() else 0
    with open(log, "ab") as f:
        proc = subprocess.Popen([nats_server_binary(), "-c", str(config or out / auth_cmd.CONFIG_NAME)],
                                stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while "Server is ready" not in log.read_bytes()[offset:].decode(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"nats-server did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.02)
    return proc


def stop_server(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=10)


def init_args(out: Path, port: int, **over) -> argparse.Namespace:
    base = dict(out=out, tls=False, hosts=None, tls_cert=None, tls_key=None, tls_ca=None, worker_ids="",
                listen=f"127.0.0.1:{port}", http=f"127.0.0.1:{free_port()}", store_dir=str(out.parent / "js"),
                server_dir=None, max_payload=1024 * 1024, force=False)
    return argparse.Namespace(**{**base, **over})


def launch(tmp_path: Path, **over) -> Iterator[AuthServer]:
    port = free_port()
    out = tmp_path / "auth"
    args = init_args(out, port, **over)
    auth_cmd.init(args)
    leaf = getattr(args, "leaf_listen", None)
    server = AuthServer(out, port, tls=bool(over.get("tls") or over.get("tls_cert")),
                        leaf_port=int(leaf.rpartition(":")[2]) if leaf else 0, log=tmp_path / "nats.log")
    server.proc = start_server(out, server.log)
    try:
        yield server
    finally:
        stop_server(server.proc)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[AuthServer]:
    yield from launch(tmp_path)


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[AuthServer]:
    yield from launch(tmp_path, tls=True, hosts=["127.0.0.1", "localhost"])


@pytest.fixture
def pinned_server(tmp_path: Path) -> Iterator[AuthServer]:
    yield from launch(tmp_path, worker_ids="w1,w2")


@dataclass
class Client:
    """A connection as a role, recording the errors the server reports (permission violations)."""

    nc: nats.NATS
    errors: list[str] = field(default_factory=list)
    got_error: asyncio.Event = field(default_factory=asyncio.Event)

    async def violation(self, subject: str) -> str:
        """Wait for the server to report a permissions violation naming `subject` (nats-py lower-cases it)."""
        subject = subject.lower()
        async with asyncio.timeout(OP_TIMEOUT_S):
            while not any(subject in e.lower() for e in self.errors):
                self.got_error.clear()
                await self.got_error.wait()
        return next(e for e in self.errors if subject in e.lower())


@pytest.fixture
async def connect() -> AsyncIterator:
    clients: list[Client] = []

    async def make(settings, role: str, **options) -> Client:
        client = Client(nc=None)  # type: ignore[arg-type]

        async def on_error(e: Exception) -> None:
            client.errors.append(str(e))
            client.got_error.set()

        client.nc = await receive.connect(settings.nats_url, allow_reconnect=False, connect_timeout=OP_TIMEOUT_S,
                                       error_cb=on_error, **{**auth.connect_options(settings, role), **options})
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.nc.close()


async def refused(url: str, **options) -> str:
    """The error a connection attempt ends with (the test fails if it connects)."""
    async def quiet(e: Exception) -> None:
        pass

    nc = nats.NATS()
    try:
        await nc.connect(url, allow_reconnect=False, connect_timeout=OP_TIMEOUT_S, error_cb=quiet, **options)
    except Exception as e:
        discard(nc)
        return str(e)
    await nc.close()
    pytest.fail(f"connected to {url} with {sorted(options)}")


def discard(nc: nats.NATS) -> None:
    """Close a refused client's sockets: nats-py leaves them open, and its close() hangs after a TLS failure."""
    transport = nc._transport
    if transport is not None:
        for writer in {transport._io_writer, transport._bare_io_writer} - {None}:
            writer.close()


def heartbeat(worker_id: str) -> bytes:
    profile = DeviceProfile(flops=1e9, memory_bytes=1 << 20, downlink_bytes_per_s=1e6, uplink_bytes_per_s=1e6,
                            latency_s=0.0)
    return codec.encode(Heartbeat(worker_id=worker_id, profile=profile, sent_at=1.0, started_at=0.0))
