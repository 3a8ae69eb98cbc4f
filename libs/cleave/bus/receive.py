"""A large message's payload gathered once, into a buffer of its size, as its bytes arrive.

nats-py's parser appends every read from the socket to one growing buffer and, once a message's payload is all
there, slices it out and converts the slice to `bytes`: a payload is copied three times by the parser alone. For
a message (without headers) of `GATHER_BYTES` or more, this parser instead copies each read straight into a
buffer of the payload's size and hands that buffer (a `bytearray`) to the subscription as the message's data
(the buffer of one of the last payloads it handed on, once nothing else holds it: not zeroed and mapped anew);
to Cleave's own subscriptions (`hand_views`, `Bus.subscribe`) it hands a read-only view of the buffer instead,
which keeps its length, so that a payload shorter than the last does not give back memory the next one would
have to write again; everything else (control lines, small messages, messages with headers) goes through nats-py's own code.

The connection's bytes come through `Transport` instead of nats-py's (asyncio's streams copy every byte twice
after the kernel: into the stream's buffer, and out of it into a new `bytes` for each read): the kernel reads
them into a buffer of the transport's, whose pieces the parser reads in order, or, while the parser gathers a
large payload and has parsed everything before it, straight into that payload. A large payload is then copied
once, by the kernel.

Any failure while parsing is raised as a protocol error, on which nats-py reconnects (on any other exception its
read loop stops, and the connection stays deaf until its pings go unanswered, minutes later). A payload that
something still has a view of when it is whole is handed on as a copy (logged with what holds the view).

A `flush()` (a PING, done when its PONG comes back) also goes after the commands written before it: nats-py writes
the PING straight to the socket, ahead of what its flusher task has not sent yet, so a `flush()` after
`subscribe()` could return before the server had the SUB, and a message published meanwhile was never delivered.
"""

from __future__ import annotations

import asyncio
import gc
import mmap
import sys
import time
from collections import deque

import structlog
from nats import errors as nats_errors
from nats.aio.client import DEFAULT_BUFFER_SIZE, PING_PROTO, Client
from nats.protocol.parser import AWAITING_CONTROL_LINE, AWAITING_MSG_PAYLOAD, CRLF_SIZE, ProtocolError
from nats.protocol.parser import Parser as NatsParser

from cleave.bus.send import Sender

log = structlog.get_logger("cleave.bus")

GATHER_BYTES = 256 * 1024  # a payload this large is gathered; smaller ones are cheap either way
SCRATCH_BYTES = 256 * 1024  # the transport's buffer for the kernel's reads (asyncio's own read size)
MIN_READ_BYTES = 16 * 1024  # less room than this left in it: a new buffer (or the same, once all is parsed)
SPARE_PAYLOADS = 6  # gathered payloads kept to gather into again (at most this many x max_payload bytes)
QUEUED_BYTES = 8 * 1024 * 1024  # received and not yet parsed: past this the socket is not read until half is
_CRLF = b"\r\n"


class Parser(NatsParser):
    """nats-py's parser with large payloads gathered in place (install before the client connects)."""

    def __init__(self, nc=None) -> None:  # noqa: ANN001 - nats-py's Client
        self.views: set[int] = set()  # subscriptions (sids) that take a read-only view (`hand_views`): kept on reset
        super().__init__(nc)

    def reset(self) -> None:
        super().reset()
        self.payload: bytearray | None = None  # the buffer the payload being gathered goes to
        self.have = 0
        self.want = 0  # the bytes of it the payload takes, with its CRLF
        self.spare: deque[bytearray] = deque(maxlen=SPARE_PAYLOADS)  # the last payloads handed on

    def _buffer(self, size: int, keep: bool) -> bytearray:
        """Room for a payload of `size` bytes with its CRLF: a spare that nothing holds any more (only `spare`
        refers to it; its old contents are read over), the shortest that is long enough, else the longest,
        lengthened (within the memory it has, or by `realloc`, which moves a large buffer's pages rather than
        copy them; its new bytes read from the kernel's zero page, `_zeros`), else a new buffer, which Python
        zeroes and the kernel maps a page at a time. `keep`: the payload is handed on as a view, and the spare
        keeps its length; else it is cut to `size` (CPython gives back the memory of a bytearray cut to less
        than half its length: lengthening it again writes every new byte)."""
        free = [i for i in range(len(self.spare)) if sys.getrefcount(self.spare[i]) == 2]  # spare, argument
        if not free:
            return bytearray(size)
        room = 0 if keep else CRLF_SIZE  # (a spare cut for a bytearray payload still has its CRLF's memory)
        fits = [i for i in free if len(self.spare[i]) + room >= size]
        i = min(fits, key=lambda i: len(self.spare[i])) if fits else max(free, key=lambda i: len(self.spare[i]))
        buf = self.spare[i]
        del self.spare[i]
        try:
            if len(buf) > size and not keep:
                del buf[size:]
            elif len(buf) < size:
                buf += _zeros(size - len(buf))  # (its CRLF's room, and what this payload is longer)
        except BufferError:  # (something has a view of it after all: left to its holder)
            return bytearray(size)
        return buf

    async def parse(self, data: bytes = b"") -> None:
        """Parse what the connection read next. Any failure is a protocol error, so that nats-py reconnects (its
        read loop stops reading for good on any other exception: the connection would stay deaf, and look alive,
        until its pings went unanswered, minutes later)."""
        try:
            await self._parse(data)
        except ProtocolError:
            raise
        except Exception as e:
            log.error("receive_failed", error=repr(e))
            raise ProtocolError(f"nats: {e!r}") from e

    async def _parse(self, data: bytes) -> None:
        view = memoryview(data)
        while True:
            if self.payload is None:
                if not (self.state == AWAITING_MSG_PAYLOAD and self.header_needed == 0 and self.needed >= GATHER_BYTES
                        and len(self.buf) < self.needed + CRLF_SIZE):
                    break
                self.want = self.needed + CRLF_SIZE  # a large payload starts: what nats-py holds first
                self.payload = self._buffer(self.want, self.msg_arg["sid"] in self.views)
                self.have = len(self.buf)
                self.payload[: self.have] = self.buf
                del self.buf[:]
            take = min(len(view), self.want - self.have)
            self.payload[self.have : self.have + take] = view[:take]
            self.have += take
            view = view[take:]
            if self.have < self.want:
                return
            payload, self.payload = self.payload, None
            size = self.want - CRLF_SIZE
            if payload[size : self.want] != _CRLF:
                raise ProtocolError("nats: a message's payload is longer than its size")
            args, self.state = self.msg_arg, AWAITING_CONTROL_LINE
            if args["sid"] in self.views:  # read where it was gathered; the spare keeps its length
                self.spare.append(payload)
                payload = memoryview(payload)[:size].toreadonly()
            else:
                try:
                    del payload[size:]  # at the end: no copy
                    self.spare.append(payload)
                except BufferError:  # something still has a view of it: handed on as a copy, never gathered into again
                    log.warning("receive_buffer_viewed", bytes=len(payload), held_by=_holders(payload))
                    payload = bytearray(memoryview(payload)[:size])
            await self.nc._process_msg(args["sid"], args["subject"], args["reply"], payload, None)
        if len(view):
            await super().parse(view)


_ZEROS: list[mmap.mmap] = []


def _zeros(n: int) -> memoryview:
    """`n` zero bytes to append, read from an anonymous mapping never written: every page of it is the kernel's
    one zero page, so it costs no memory and the copy reads from cache (`bytes(n)` would zero `n` new bytes
    first)."""
    if not _ZEROS or len(_ZEROS[0]) < n:
        _ZEROS[:] = [mmap.mmap(-1, max(n, 1), prot=mmap.PROT_READ)]
    return memoryview(_ZEROS[0])[:n]


def _holders(buf: bytearray) -> list[str]:
    """What holds the views of `buf` (for a log line): each holder's type, or a frame's function."""
    mbufs = [r for r in gc.get_referrers(buf) if type(r).__name__ == "managedbuffer"]
    views = [r for m in mbufs for r in gc.get_referrers(m) if isinstance(r, memoryview)]
    found = {getattr(getattr(h, "f_code", None), "co_qualname", None) or type(h).__name__
             for v in views for h in gc.get_referrers(v) if h is not views}
    return sorted(found) or ["nothing alive: an export without a view"]


class Stream(asyncio.BufferedProtocol):
    """One connection's bytes as they arrive (asyncio's protocol for it; `Transport` reads them)."""

    def __init__(self, parser: Parser) -> None:
        self.parser = parser
        self.transport: asyncio.Transport | None = None
        self.pieces: deque[memoryview] = deque()  # received, not yet read, in order
        self.queued = 0  # their bytes
        self.scratch, self.used = bytearray(SCRATCH_BYTES), 0
        self.direct = False  # the buffer last given to the kernel is the payload being gathered
        self.reading = False  # the client reads messages (its handshake is over: the parser is this connection's)
        self.out = False  # the piece `read` returned last may not be parsed yet
        self.paused = False  # the socket is not read (too much queued)
        self.error: BaseException | None = None
        self.eof = self.lost = self.write_paused = False
        self.wakers: list[asyncio.Future] = []  # a reader waiting for bytes, writers for the socket to drain
        self.closed = asyncio.get_running_loop().create_future()
        self.sender: Sender | None = None  # writes this connection's bytes, when asyncio's transport does not

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # (again for TLS, with its transport)
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        p = self.parser
        if self.reading and p.payload is not None and not self.pieces and not self.out:
            self.direct = True
            return memoryview(p.payload)[p.have : p.want]
        self.direct = False
        if not self.pieces and not self.out:
            self.used = 0  # all parsed (the parser copies what it keeps): the buffer is free again
        elif len(self.scratch) - self.used < MIN_READ_BYTES:
            self.scratch, self.used = bytearray(SCRATCH_BYTES), 0
        return memoryview(self.scratch)[self.used:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.direct:
            self.parser.have += nbytes
            if self.parser.have == self.parser.want:  # complete: an empty piece has the parser finish it
                self._queue(memoryview(b""))
            return
        self._queue(memoryview(self.scratch)[self.used:self.used + nbytes])
        self.used += nbytes

    def _queue(self, piece: memoryview) -> None:
        self.pieces.append(piece)
        self.queued += len(piece)
        if self.queued > QUEUED_BYTES and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def _wake(self) -> None:
        for f in self.wakers:
            if not f.done():
                f.set_result(None)
        self.wakers.clear()

    async def wait(self) -> None:
        f = asyncio.get_running_loop().create_future()
        self.wakers.append(f)
        await f

    async def arrived(self) -> bool:
        """Until a piece is queued (True) or the connection has ended (False; its error raised, if any)."""
        while not self.pieces:
            if self.eof:
                if self.error is not None:
                    raise self.error
                return False
            await self.wait()
        return True

    def take(self, piece: memoryview) -> None:
        """`piece` was read (the first of `pieces`, or its front)."""
        self.queued -= len(piece)
        if self.paused and self.queued <= QUEUED_BYTES // 2:
            self.paused = False
            self.transport.resume_reading()

    def eof_received(self) -> None:
        self.eof = True
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = self.lost = True
        if self.sender is not None:
            self.sender.lost(exc)
        self.error = exc
        self._wake()
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake()


class Transport:
    """nats-py's transport for a TCP connection (with or without TLS), reading through `Stream`; writes go
    through a `Sender` (without TLS, on a selector loop: not copied) or to asyncio's transport as nats-py's own do."""

    def __init__(self, parser: Parser) -> None:
        self.parser = parser
        self.stream: Stream | None = None  # this connection's (a new one for every connection)

    async def connect(self, uri, buffer_size: int, connect_timeout: float) -> None:  # noqa: ANN001 - ParseResult
        stream = Stream(self.parser)
        transport, _ = await asyncio.wait_for(
            asyncio.get_running_loop().create_connection(lambda: stream, uri.hostname, uri.port), connect_timeout)
        if Sender.usable(transport):
            stream.sender = Sender(transport)
        self.stream = stream

    async def connect_tls(self, uri, ssl_context, buffer_size: int, connect_timeout: float) -> None:  # noqa: ANN001
        s = self.stream
        if s.sender is not None:  # what went before the handshake, then the TLS layer writes
            await s.sender.sent()
            s.sender = None
        s.transport = await asyncio.wait_for(asyncio.get_running_loop().start_tls(
            s.transport, s, ssl_context, server_hostname=uri if isinstance(uri, str) else uri.hostname),
            connect_timeout)

    async def read(self, buffer_size: int) -> memoryview | bytes:
        """The next piece received, in order; b"" at the end of the connection (its error raised, if any)."""
        s = self.stream
        s.reading, s.out = True, False
        if not await s.arrived():
            return b""
        piece = s.pieces.popleft()
        s.take(piece)
        s.out = True
        return piece

    async def readline(self) -> bytes:
        s, line = self.stream, bytearray()
        while True:
            if not await s.arrived():
                return bytes(line)
            piece = s.pieces[0]
            end = bytes(piece).find(b"\n") + 1  # (the handshake's lines: short)
            taken = piece[:end] if end else piece
            line += taken
            s.take(taken)
            if end and end < len(piece):
                s.pieces[0] = piece[end:]
            else:
                s.pieces.popleft()
            if end:
                return bytes(line)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send `data` in order after what was written before; until `sent()` returns, its buffer must not change."""
        s = self.stream
        (s.sender or s.transport).write(data)

    def writelines(self, data: list[bytes]) -> None:
        s = self.stream
        (s.sender or s.transport).writelines(data)

    async def sent(self) -> None:
        """Until what was written may change: the kernel has it (a `Sender`), or asyncio's transport copied it."""
        if self.stream.sender is None:
            await self.drain()
        else:
            await self.stream.sender.sent()

    async def drain(self) -> None:
        """Until the socket has taken what was written, to asyncio's limit (as asyncio's streams drain)."""
        s = self.stream
        if s.sender is not None:
            return await s.sender.drain()
        if s.transport.is_closing():
            await asyncio.sleep(0)  # (the connection's loss, if that is why, is reported first)
        while s.write_paused and not s.lost:
            await s.wait()
        if s.lost:
            raise ConnectionResetError("Connection lost")

    async def wait_closed(self) -> None:
        if self.stream is not None:
            await asyncio.shield(self.stream.closed)

    def close(self) -> None:
        if self.stream is not None and self.stream.transport is not None:
            (self.stream.sender or self.stream.transport).close()

    def at_eof(self) -> bool:
        return self.stream is None or (self.stream.eof and not self.stream.pieces)

    def __bool__(self) -> bool:
        return self.stream is not None and self.stream.transport is not None


class TlsRefused(nats_errors.Error):
    """A server that does not require TLS at a tls:// URL (nats-py retries, as for any server that cannot be
    used, and its error callback logs this)."""


class _Client(Client):
    async def _send_ping(self, future: asyncio.Future | None = None) -> None:
        """nats-py's, with the PING queued behind the pending commands (see the module's doc)."""
        self._pongs.append(future if future is not None else asyncio.get_running_loop().create_future())
        await self._send_command(PING_PROTO)
        await self._flush_pending()

    async def _connect_to_server(self, s) -> None:  # noqa: ANN001 - nats-py's Srv
        """nats-py's, with `Transport` for TCP (WebSocket URLs: nats-py's own)."""
        if s.uri.scheme in ("ws", "wss"):
            return await super()._connect_to_server(s)
        s.last_attempt = time.monotonic()
        if not isinstance(self._transport, Transport):
            self._transport = Transport(self._ps)
        await self._transport.connect(s.uri, DEFAULT_BUFFER_SIZE, self.options["connect_timeout"])

    async def _process_info(self, info: dict, initial_connection: bool = False) -> None:
        """nats-py's, refusing a server that does not require TLS at a tls:// URL: nats-py would go on in plain
        text, login and all, with whatever answers at the address (a nats:// URL takes TLS where the server
        requires it, with the CA given)."""
        server = self._current_server
        asked = server is not None and server.uri.scheme == "tls" and not self.options["tls_handshake_first"]
        if initial_connection and asked and not info.get("tls_required"):
            raise TlsRefused(f"NATS at {server.uri.geturl()} does not require TLS, which its tls:// URL asks for: "
                             "not sending anything in plain text")
        await super()._process_info(info, initial_connection)


def hand_views(nc: Client, sid: int) -> None:
    """Large payloads of subscription `sid` of `nc` (a `client()`) are handed on as read-only memoryviews over
    the buffer they were gathered in, which keeps its length for the next payload: for a handler that reads
    them and lets them go (not `bytes` concatenation, as nats-py's object store does)."""
    if isinstance(getattr(nc, "_ps", None), Parser):
        nc._ps.views.add(sid)


def client() -> Client:
    """A nats-py client, not yet connected, that parses with `Parser`, reads through `Transport` and flushes in order."""
    nc = _Client()
    nc._ps = Parser(nc)
    return nc


async def connect(url: str | list[str], **options) -> Client:
    """`nats.connect(url, **options)`, with `client()`."""
    nc = client()
    await nc.connect(url, **options)
    return nc
