"""Large messages written to the connection's socket as their pieces, not joined first.

nats-py builds a PUB command by concatenating its line, the payload and CRLF, and its flusher joins the
queued commands into one buffer for the socket: a payload is copied three times before the kernel copies it. A
message of `DIRECT_BYTES` or more is instead written straight to the connection's transport, its small pieces
joined with the PUB line: Cleave's transport (`receive.Transport`) hands them to the kernel as they are
(`send.Sender`; with TLS, asyncio's transport sends what the socket takes at once and copies the rest into its
buffer, once). Then it waits until the kernel has them all (or, with TLS, until that buffer drains, as nats-py's
flusher waits), so a publisher cannot run ahead of the socket, and the pieces' buffers may change once it
returns; a publisher of several messages may instead write them all and wait once (`wait=False`, `settled`), so
that they leave in one system call. Commands nats-py has queued and not yet written go first (nothing is reordered). Only
while the connection is up and not draining, over TCP (with or without TLS), and for a plain subject;
otherwise nats-py publishes it.
"""

from __future__ import annotations

import asyncio
import re

import structlog
from nats.aio.client import Client
from nats.aio.transport import TcpTransport

from cleave import codec
from cleave.bus import receive
from cleave.codec import Piece

log = structlog.get_logger("cleave.bus")
DIRECT_BYTES = 64 * 1024  # a message this large goes to the socket as its pieces; smaller ones (which nats-py
# batches into one write with others), and pieces smaller than this, are joined
_PLAIN_SUBJECT = re.compile(r"[!-~]+")  # printable ASCII, no white space: safe in a PUB line as it is
_CRLF = b"\r\n"


async def publish(nc: Client, subject: str, pieces: list[Piece], max_payload: int, timeout_s: float,
                  wait: bool = True) -> int:
    """The frame that `pieces` make in chunks of at most `max_payload` (`codec.split_pieces`), each published
    with `put`; returns the bytes put on the wire."""
    sent = 0
    for message in codec.split_pieces(pieces, max_payload):
        size = sum(len(p) for p in message)
        await put(nc, subject, message, size, timeout_s, wait)
        sent += size
    return sent


async def put(nc: Client, subject: str, message: list[Piece], size: int, timeout_s: float, wait: bool = True) -> None:
    """Publish one NATS message of `size` bytes made of `message`'s pieces (at most the server's max_payload).
    `wait=False`: return once it is written, before the kernel has it; `settled` then waits for it and for
    every message written with it (their pieces' buffers must not change until then), in one system call."""
    transport = getattr(nc, "_transport", None)
    if (size < DIRECT_BYTES or not nc.is_connected or nc.is_draining or not isinstance(transport, (TcpTransport, receive.Transport))
            or not isinstance(getattr(nc, "_pending", None), list) or not _PLAIN_SUBJECT.fullmatch(subject)):
        await nc.publish(subject, message[0] if len(message) == 1 else b"".join(message))
        return
    if nc._pending:  # what nats-py has queued goes first, written as its own flusher writes it
        transport.writelines(nc._pending)
        nc._pending = []
        nc._pending_data_size = 0
    line = bytearray(f"PUB {subject} {size}\r\n".encode())
    for piece in message:
        if len(piece) < DIRECT_BYTES:
            line += piece
        else:
            transport.write(line)
            transport.write(piece)
            line = bytearray()
    line += _CRLF
    transport.write(line)
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += size
    if wait:
        await settled(nc, timeout_s, subject, size)


async def settled(nc: Client, timeout_s: float, subject: str = "", size: int = 0) -> None:
    """Until the kernel has every message written to the socket (with TLS: until asyncio's buffer drains), at
    most `timeout_s`; raises ConnectionResetError if the connection is lost first."""
    transport = getattr(nc, "_transport", None)
    if not isinstance(transport, (TcpTransport, receive.Transport)):
        return
    try:
        await asyncio.wait_for(transport.sent() if isinstance(transport, receive.Transport) else transport.drain(),
                               timeout_s)
    except TimeoutError:  # queued all the same, as nats-py leaves a message whose flush timed out
        log.warning("publish_slow", subject=subject, bytes=size)
