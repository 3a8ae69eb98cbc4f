"""NATS URLs are checked before anything dials them, and a tls:// URL never falls back to plain text.

- A URL nats-py cannot use (empty, another scheme, no host, a bad port) is named at once by the services'
  settings, the CLI and the Python API, instead of being retried for ever (nats-py spins at full CPU on an empty
  list of servers).
- nats-py, given tls://, upgrades to TLS only when the server's INFO says `tls_required`: something in the middle
  that answers with a plain INFO (here a relay to a real plain nats-server, whose INFO carries the real server's
  nonce) would get the client's CONNECT, its login with it, in plain text. Cleave's client sends nothing.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from cleave.bus import receive, urls
from cleave.errors import ConfigError


@pytest.mark.parametrize("url", ["", " , ", "http://127.0.0.1:4222", "not a url", "nats://:4222",
                                 "nats://127.0.0.1:99999", "nats://127.0.0.1:4222,ftp://x:1"])
def test_a_url_nats_py_cannot_use_is_refused_by_name(url: str) -> None:
    with pytest.raises(ConfigError, match="expected nats://HOST:PORT or tls://HOST:PORT"):
        urls.servers(url)


def test_every_url_form_the_docs_use_is_accepted() -> None:
    for url in ("nats://127.0.0.1:4222", "127.0.0.1:4222", "localhost", "tls://hub.example.org:4222",
                "nats://a:1,nats://b:2,nats://c:3", "nats://[::1]:4222", "ws://h:8080", "wss://h"):
        assert urls.servers(url)


@pytest.mark.parametrize("service", ["worker", "scheduler", "ps", "monitor"])
def test_a_service_given_an_empty_url_stops_at_once_with_its_name(service: str) -> None:
    env = {"PATH": "/usr/bin:/bin", f"CLEAVE_{service.upper()}_NATS_URL": ""}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "cleave_cli", service], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "invalid setting nats_url: '': no server in it" in out.stderr
    assert "Traceback" not in out.stderr and time.monotonic() - t0 < 60


async def relay(server_port: int, seen: bytearray) -> asyncio.Server:
    """A listener that passes bytes both ways to the real server, keeping what the client sent."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keep: bytearray | None) -> None:
        while data := await reader.read(65536):
            if keep is not None:
                keep.extend(data)
            writer.write(data)
            await writer.drain()
        writer.close()

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", server_port)
        await asyncio.gather(pipe(up_reader, writer, None), pipe(reader, up_writer, seen), return_exceptions=True)

    return await asyncio.start_server(on_client, "127.0.0.1", 0)


def test_a_tls_url_sends_nothing_to_a_server_that_answers_in_plain_text(nats_server) -> None:  # noqa: ANN001
    async def attempt(scheme: str) -> tuple[bytes, BaseException | None]:
        seen = bytearray()
        listener = await relay(nats_server.port, seen)
        port = listener.sockets[0].getsockname()[1]
        nc = receive.client()
        try:
            await nc.connect([f"{scheme}://127.0.0.1:{port}"], allow_reconnect=False, connect_timeout=5,
                             user="someone", password="secret")
            error = None
        except Exception as e:  # noqa: BLE001 - what the connection raised is the finding
            error = e
        await nc.close()
        await asyncio.sleep(0.2)
        listener.close()
        return bytes(seen), error

    sent, error = asyncio.run(attempt("tls"))
    assert isinstance(error, receive.TlsRefused) and "does not require TLS" in str(error)
    assert sent == b"", sent  # no CONNECT: neither the password nor anything else left in plain text
    sent, error = asyncio.run(attempt("nats"))  # the control: through the same relay, nats:// logs in
    assert b"CONNECT" in sent and b"secret" in sent
