"""NATS URLs as nats-py dials them, checked before anything dials: a wrong one is named at once, not retried for
ever (nats-py spins on an empty list of servers and retries a host that cannot exist as if it were down)."""

from __future__ import annotations

from urllib.parse import urlsplit

from cleave.errors import ConfigError
from cleave.schemas.base import checked_str

SCHEMES = ("nats", "tls", "ws", "wss")  # what nats-py dials
EXPECTED = "nats://HOST:PORT or tls://HOST:PORT (a cluster: several, comma-separated)"


def servers(url: object, flag: str = "--nats") -> list[str]:
    """The servers of `url` (one, or several comma-separated); ConfigError naming `flag` (if any) unless each has
    a scheme nats-py dials (none: nats://), a host and a port up to 65535."""
    named = f"{flag} {url!r}" if flag else repr(url)
    if not isinstance(url, str):
        raise ConfigError(f"{named}: expected a URL string, {EXPECTED}")
    found = [part.strip() for part in url.split(",") if part.strip()]
    if not found:
        raise ConfigError(f"{named}: no server in it; expected {EXPECTED}")
    for server in found:
        parts = urlsplit(server if "://" in server else f"nats://{server}")
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in SCHEMES or not parts.hostname or port in (-1, 0) or any(c.isspace() for c in server):
            which = "" if len(found) == 1 else f" {server!r}"
            raise ConfigError(f"{named}:{which} not a NATS server's URL; expected {EXPECTED}")
    return found


NatsUrl = checked_str(lambda url: servers(url, ""))  # a settings field's type: a URL `servers` accepts
