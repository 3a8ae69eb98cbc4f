"""A command's first contact with a hub's NATS, and what went wrong in words. nats-py retries any server it
cannot use, logging each error, so a command that dials a hub with the wrong CA, another deployment's
credential or the leaf-node port waited out its whole timeout and said only "could not reach". One bounded try
first tells these apart: a refusal that no retry can mend is said at once; a server that is not up (yet) or does
not answer is retried as before, and the final message names what the first try met."""

from __future__ import annotations

import asyncio
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats.errors

from cleave.api.credentials import ca_file
from cleave.bus import receive, urls

DEFAULT_TRY_S = 5.0  # the first try's limit (each server dialled at most twice)
DEFAULT_CONNECT_S = 2.0  # each TCP (and TLS) connection's


@dataclass(frozen=True)
class Refusal:
    reason: str  # one sentence, for after "NATS at URL: ..."
    final: bool  # retrying cannot mend it (a certificate, a credential, the wrong port)
    credential: bool = False  # the server refused the login (none given, or one it does not know)


def refusal(errors: list[BaseException], info: dict, folder: Path | None, role: str,
            host: str = "HOST") -> Refusal | None:
    """Why a try at `host` whose error callback saw `errors` (the server's INFO: `info`, if one came) failed;
    the most telling error wins (a certificate or credential over a later timeout); None for no error."""
    said = [r for r in (_one(e, info, folder, role, host) for e in errors) if r is not None]
    return next((r for r in said if r.final), said[-1] if said else None)


def _one(e: BaseException, info: dict, folder: Path | None, role: str, host: str) -> Refusal | None:
    auth_hint = (f"is {folder} the folder `cleave auth init` wrote for this hub (or the copy it gave you)?"
                 if folder is not None else "pass --auth DIR, the folder `cleave auth init` wrote for this hub")
    if isinstance(e, ssl.SSLCertVerificationError):
        what = e.verify_message or str(e)
        if "mismatch" in what.lower():  # a hostname or IP address the certificate does not name
            return Refusal(f"its certificate does not name {host} ({what.rstrip('.')}): dial a name it has, or "
                           f"make it anew on the hub with `cleave auth init --tls --host {host}`", True)
        ca = ca_file(folder) if folder is not None else None
        trust = f"{ca} did not sign it" if ca is not None else "this machine's trust store does not trust it"
        return Refusal(f"it showed a TLS certificate and {trust} ({what}): {auth_hint}", True)
    if isinstance(e, ssl.SSLError):
        return Refusal(f"the TLS handshake failed ({e.reason or e}): is the URL the hub's client port?", True)
    if isinstance(e, receive.TlsRefused):
        return Refusal("it does not serve TLS, which its tls:// URL asks for: nothing was sent (a hub without "
                       "--auth is dialled at nats://)", True)
    if isinstance(e, nats.errors.AuthorizationError) or "authorization violation" in str(e).lower():
        if info.get("leafnode_urls"):
            return Refusal("that is the hub's leaf-node port, for `cleave site`; commands dial its client port "
                           "(`cleave up` prints it: NATS tls://HOST:PORT)", True)
        if folder is None:
            return Refusal(f"it asks for a credential (Authorization Violation): {auth_hint}", True, True)
        return Refusal(f"it refused the credential {folder / f'{role}.env'} (Authorization Violation), which is "
                       f"none of its users: {auth_hint}", True, True)
    if isinstance(e, socket.gaierror):
        return Refusal(f"its host name is not known here ({e.strerror or e})", True)
    if isinstance(e, ConnectionRefusedError):
        return Refusal("nothing listens there (connection refused): is the hub up, and is this its client port?",
                       False)
    if isinstance(e, TimeoutError | nats.errors.TimeoutError):
        return Refusal("no answer: is the port open to you? (a firewall drops what it does not let through)", False)
    if isinstance(e, nats.errors.NoServersError):
        return None  # (nats-py's summary once every server failed: the errors before it say why)
    return Refusal(f"{type(e).__name__}: {e}", False)


async def first_try(url: str, options: dict[str, Any], folder: Path | None, role: str,
                    limit_s: float = DEFAULT_TRY_S) -> Refusal | None:
    """Log in at `url` once (each of its servers at most twice) with `options` and out again: None when that
    worked, else why not."""
    errors: list[BaseException] = []

    async def seen(e: Exception) -> None:
        errors.append(e)

    servers = urls.servers(url)
    first = servers[0] if "://" in servers[0] else f"nats://{servers[0]}"
    host = (urlsplit(first).hostname if len(servers) == 1 else None) or "HOST"  # (a cluster: which one is unsaid)
    nc = receive.client()
    try:
        await asyncio.wait_for(nc.connect(
            servers, connect_timeout=DEFAULT_CONNECT_S, allow_reconnect=False, max_reconnect_attempts=1,
            reconnect_time_wait=0.1, error_cb=seen, **options), limit_s)
    except Exception as e:  # noqa: BLE001 - what nats-py raises varies; the callback's errors say more
        errors.append(e)
        await asyncio.gather(nc.close(), return_exceptions=True)
        info = getattr(nc, "_server_info", None) or {}
        return refusal(errors, info, folder, role, host) or Refusal(repr(e), False)
    await nc.close()
    return None
