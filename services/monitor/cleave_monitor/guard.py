"""Who may read the dashboard: the Host header checked on every request, and a token beyond localhost.

- Host: on a loopback address without a token, only the loopback names (`localhost`, `127.0.0.1`, `[::1]`)
  and the names in `allowed_hosts` are answered: a page elsewhere that rebinds its own name to this machine
  (DNS rebinding) is refused (403). With a token, `allowed_hosts` (when set) is the list; else any name.
- Token: set when the monitor listens beyond localhost (given as CLEAVE_MONITOR_TOKEN, or made up at start and
  logged with the URL). A request carries it as `?token=`, an `Authorization: Bearer` header (Prometheus) or
  the cookie the first `?token=` sets (HttpOnly, SameSite=Strict), so the page's own requests need nothing
  more. Without it: 401. `/healthz` (a container's health check) is always answered; it tells nothing.
"""

from __future__ import annotations

import hmac
import secrets

from aiohttp import web

LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD = frozenset({"0.0.0.0", "::", ""})
COOKIE = "cleave_token"
OPEN_PATHS = frozenset({"/healthz"})


def needs_token(host: str) -> bool:
    return host not in LOOPBACK


def new_token() -> str:
    return secrets.token_urlsafe(24)


def host_name(header: str) -> str:
    """The name of a Host header, without its port (and brackets of an IPv6 literal)."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(header: str, bind: str, token: str, allowed: frozenset[str]) -> bool:
    name = host_name(header).lower()
    if name in LOOPBACK or name in allowed or (bind not in WILDCARD and name == bind.lower()):
        return True
    return bool(token) and not allowed


def presented(request: web.Request) -> str:
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":  # (an auth scheme is case-insensitive: RFC 7235)
        return credentials.strip()
    return request.query.get("token") or request.cookies.get(COOKIE, "")


def middleware(bind: str, token: str, allowed: frozenset[str]):  # noqa: ANN201 - an aiohttp middleware
    @web.middleware
    async def guard(request: web.Request, handler):  # noqa: ANN001, ANN202
        if request.path in OPEN_PATHS:
            return await handler(request)
        if not host_allowed(request.host or "", bind, token, allowed):
            raise web.HTTPForbidden(text=f"Host {request.host!r} is not this dashboard's name; add it to "
                                         "CLEAVE_MONITOR_ALLOWED_HOSTS")
        if token:
            if not hmac.compare_digest(presented(request).encode(), token.encode()):
                raise web.HTTPUnauthorized(text="this dashboard asks for its token: open the URL `cleave up` "
                                                "printed (…/?token=...)")
            if request.query.get("token"):  # remember it for the page's own requests
                response = await handler(request)
                response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
                return response
        return await handler(request)

    return guard
