"""A connection's writes sent from the writers' own buffers, not copied into one.

asyncio's socket transport (Python 3.11) sends what the socket takes of a write at once and copies the rest into
one growing buffer, which it sends from as the socket drains: a tile's block, written from its tensor's memory,
was copied once more in Python before the kernel copied it. `Sender` keeps the written objects themselves, in
order, and hands the kernel as many of them as it takes in one vectored write (`os.writev`) once the loop's
callback that wrote them is done, and then whenever the socket has room: a byte is copied by the kernel alone,
and a message written as several pieces (its header, its blocks, its end) leaves in one system call. A writer
that will change its buffers awaits `sent()` (the kernel has every byte written so far, or what is left was
copied) first; nats-py's own writes are `bytes`, which nothing changes.

`receive.Transport` writes through a `Sender` on a TCP connection without TLS on a selector event loop where the
system has `writev` (Linux, macOS); with TLS (which encrypts into buffers of its own anyway), on another loop
(Windows' default), asyncio's transport writes.
The sender watches the socket for room with the loop's own writer registration (`_add_writer`: asyncio's public
`add_writer` refuses a transport's socket, and the transport, written to by no one else, registers none).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from itertools import islice

IOV_MAX = 1024  # buffers in one writev (Linux's and macOS's limit)
HIGH_WATER_BYTES = 64 * 1024  # `drain()` returns once no more than this is left to send (asyncio's default)


class Sender:
    """The writes of one connection (`transport`, a plain TCP socket transport of a selector loop), in order."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        self.fd = transport.get_extra_info("socket").fileno()
        self.queue: deque[memoryview] = deque()  # written, not yet sent (the front may be a piece's tail)
        self.written = self.sent_bytes = 0  # bytes written by callers, and handed to the kernel, ever
        self.watching = False  # the loop calls `_send` when the socket has room
        self.due = False  # the loop calls `_send` once the current callback is done (`write`)
        self.closing = False  # close the transport once all is sent
        self.error: BaseException | None = None
        self.waiters: list[tuple[int, asyncio.Future]] = []  # (`sent_bytes` to wait for, its future)

    @staticmethod
    def usable(transport: asyncio.BaseTransport) -> bool:
        """Whether `transport` is one a `Sender` can write for: a selector loop's plain TCP transport (a TLS
        transport is another class), where the system has writev."""
        return hasattr(os, "writev") and isinstance(transport, asyncio.selector_events._SelectorSocketTransport)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queue `data` (kept, not copied), to be sent as soon as the current callback of the loop is done: what
        it writes meanwhile (a message's header, its blocks and its end) goes in the same vectored write, not a
        system call each. After the connection is lost or closed, writes are dropped, as asyncio's transport
        drops them (the reader reports the loss)."""
        if self.error is not None or self.closing:
            return
        view = memoryview(data).cast("B")
        if not view.nbytes:
            return
        self.queue.append(view)
        self.written += view.nbytes
        if not self.watching and not self.due:
            self.due = True
            self.loop.call_soon(self._send_due)

    def _send_due(self) -> None:
        self.due = False
        if not self.watching:
            self._send()

    def writelines(self, data: list[bytes]) -> None:
        for d in data:
            self.write(d)

    def _send(self) -> None:
        while self.queue:
            batch = list(islice(self.queue, IOV_MAX))
            try:
                n = os.writev(self.fd, batch)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # reset or closed under us: what asyncio's transport does on a failed send
                self.lost(e)
                self.transport.abort()
                return
            self.sent_bytes += n
            full = n < sum(v.nbytes for v in batch)
            while n:
                head = self.queue[0]
                if head.nbytes <= n:
                    n -= head.nbytes
                    self.queue.popleft()
                else:
                    self.queue[0] = head[n:]
                    n = 0
            if full:  # the socket took less than offered: it has no more room now
                break
        if self.queue and not self.watching:
            self.loop._add_writer(self.fd, self._send)
            self.watching = True
        elif not self.queue and self.watching:
            self._unwatch()
        self._wake()
        if self.closing and not self.queue:
            self.transport.close()

    def _unwatch(self) -> None:
        if self.watching:
            self.loop._remove_writer(self.fd)
            self.watching = False

    def _wake(self) -> None:
        if not self.waiters:
            return
        keep = []
        for until, f in self.waiters:
            if f.done():
                continue
            if self.error is not None:
                f.set_exception(ConnectionResetError(f"Connection lost: {self.error!r}"))
            elif self.sent_bytes >= until:
                f.set_result(None)
            else:
                keep.append((until, f))
        self.waiters = keep

    async def _until(self, sent_bytes: int) -> None:
        if self.error is not None:
            raise ConnectionResetError(f"Connection lost: {self.error!r}")
        if self.sent_bytes >= sent_bytes:
            return
        f = self.loop.create_future()
        self.waiters.append((sent_bytes, f))
        await f

    async def sent(self) -> None:
        """Until the kernel has every byte written so far; raises ConnectionResetError if the connection is lost
        first. Once it returns or raises (cancelled, or timed out by `wait_for`), their buffers may change: what
        is not sent by then is copied (as asyncio's transport would have)."""
        until = self.written
        try:
            await self._until(until)
        finally:
            self._own(until)

    def _own(self, until: int) -> None:
        """Copy the queued bytes written before `until` into buffers of the sender's own."""
        at, i = self.sent_bytes, 0
        while at < until and i < len(self.queue):
            view = self.queue[i]
            self.queue[i] = memoryview(bytes(view))
            at += view.nbytes
            i += 1

    async def drain(self) -> None:
        """Until no more than `HIGH_WATER_BYTES` is left to send (a writer cannot run ahead of the socket)."""
        await self._until(self.written - HIGH_WATER_BYTES)

    def close(self) -> None:
        """Close the transport once everything written is sent (as asyncio's transport closes)."""
        self.closing = True
        if not self.queue:
            self.transport.close()

    def lost(self, exc: BaseException | None) -> None:
        """The connection is gone: nothing more is sent (called before the socket is closed), waiters are told."""
        if self.error is None:
            self.error = exc if exc is not None else ConnectionResetError("the connection was closed")
        self._unwatch()
        self.queue.clear()
        self._wake()
