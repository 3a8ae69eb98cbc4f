"""Creating a JetStream stream or bucket that several services may create at once: the one that exists is
used, else it is created; when the server refuses to create it and none exists, the error says what was asked
and the server's reason (a bare "not found" hid, for one, a server without the storage for it)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.js.errors import NotFoundError

from cleave.bus.limits import MiB
from cleave.errors import CreateRefused

T = TypeVar("T")
INSUFFICIENT_STORAGE = 10047  # JetStream's err_code: its storage (max_file_store) cannot hold the limit asked


async def ensure(lookup: Callable[[], Awaitable[T]], create: Callable[[], Awaitable[T]], what: str,
                 max_bytes: int | None, timeout_s: float) -> T:
    """`lookup()`'s stream or bucket, else `create()`'s, else (created by another service meanwhile) the one
    that exists; CreateRefused when none does. `what` (e.g. "KV bucket cleave-plans") and `max_bytes` (its
    size limit) name it in that error."""
    try:
        return await asyncio.wait_for(lookup(), timeout_s)
    except NotFoundError:
        pass
    try:
        return await asyncio.wait_for(create(), timeout_s)
    except Exception as refused:  # noqa: BLE001 - created concurrently, or refused: the lookup tells
        try:
            return await asyncio.wait_for(lookup(), timeout_s)
        except NotFoundError:
            raise CreateRefused(refusal(what, max_bytes, refused)) from refused


def refusal(what: str, max_bytes: int | None, e: Exception) -> str:
    size = f" ({max_bytes / MiB:,.0f} MiB)" if max_bytes and max_bytes > 0 else ""
    reason = getattr(e, "description", None) or str(e) or type(e).__name__
    hint = "; JetStream's max_file_store must hold every limit (docs/operations.md)" \
        if getattr(e, "err_code", None) == INSUFFICIENT_STORAGE else ""
    return f"NATS refused to create {what}{size}: {reason}{hint}"
