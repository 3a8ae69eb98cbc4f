"""A connection's writes through `cleave.bus.send.Sender` over a real loopback TCP socket: the bytes arrive exactly
and in order whatever the socket takes at a time; what one callback writes goes in one system call; a written buffer is kept, not copied, until the kernel has it;
once `sent()` returns or gives up, the writer may change its buffer and the receiver still gets what was written;
`close()` sends everything first; a lost connection fails the waiters instead of hanging them."""

from __future__ import annotations

import asyncio
import random

import pytest

from cleave.bus.send import Sender

TIMEOUT_S = 30.0


class Peer:
    """The far end: a server that reads only when told to, and keeps what it read."""

    def __init__(self) -> None:
        self.got = bytearray()
        self.reading = asyncio.Event()
        self.ended = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.writer = writer
            await self.reading.wait()
            while chunk := await reader.read(1 << 20):
                self.got += chunk
            self.ended.set()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.server.close()
        await self.server.wait_closed()


async def connect(port: int) -> tuple[asyncio.Transport, Sender, asyncio.Future]:
    lost = asyncio.get_running_loop().create_future()

    class Quiet(asyncio.Protocol):
        def connection_lost(self, exc: Exception | None) -> None:
            sender.lost(exc)
            if not lost.done():
                lost.set_result(exc)

    transport, _ = await asyncio.get_running_loop().create_connection(Quiet, "127.0.0.1", port)
    assert Sender.usable(transport)
    sender = Sender(transport)
    return transport, sender, lost


async def test_bytes_arrive_exactly_and_in_order_and_close_sends_them_all():
    peer = Peer()
    transport, sender, lost = await connect(await peer.start())
    rng = random.Random(7)
    pieces = [rng.randbytes(rng.choice([0, 1, 100, 70_000, 3 << 20])) for _ in range(40)]
    try:
        partial = False
        for i, p in enumerate(pieces):
            sender.write(bytearray(p) if i % 3 else p)
            await asyncio.sleep(0)  # the write goes out once this callback is done
            partial = partial or sender.watching
            if i == 10:
                peer.reading.set()  # the first pieces fill the socket before anyone reads
        assert partial  # the socket took less than was written at least once: the rest waited, in order
        sender.close()
        await asyncio.wait_for(peer.ended.wait(), TIMEOUT_S)
        assert bytes(peer.got) == b"".join(pieces)
        await asyncio.wait_for(lost, TIMEOUT_S)
    finally:
        transport.abort()
        await peer.stop()


async def test_a_written_buffer_is_kept_not_copied_until_sent_and_copied_when_the_writer_gives_up():
    peer = Peer()
    transport, sender, _ = await connect(await peer.start())
    big = bytearray(random.Random(1).randbytes(32 << 20))  # far more than a socket's buffers hold
    want = bytes(big)
    try:
        sender.write(big)
        assert sender.queue and sender.queue[0].obj is big  # the writer's own buffer waits, not a copy of it
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sender.sent(), 0.2)  # nobody reads: it gives up
        assert all(v.obj is not big for v in sender.queue)  # what is left was copied: the writer may change it
        big[:] = bytes(len(big))
        peer.reading.set()
        await asyncio.wait_for(sender.sent(), TIMEOUT_S)
        sender.close()
        await asyncio.wait_for(peer.ended.wait(), TIMEOUT_S)
        assert bytes(peer.got) == want
    finally:
        transport.abort()
        await peer.stop()


async def test_a_lost_connection_fails_those_waiting_and_drops_later_writes():
    peer = Peer()
    transport, sender, lost = await connect(await peer.start())
    try:
        sender.write(bytes(32 << 20))
        waiting = asyncio.ensure_future(sender.sent())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        transport.abort()  # the connection goes while a writer waits
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(waiting, TIMEOUT_S)
        await asyncio.wait_for(lost, TIMEOUT_S)
        sender.write(b"after")  # dropped, as asyncio's transport drops writes after a loss
        assert not sender.queue and not sender.watching
        with pytest.raises(ConnectionResetError):
            await sender.drain()
    finally:
        await peer.stop()


async def test_what_one_callback_writes_goes_in_one_system_call(monkeypatch):
    """A message's header, its block and its end are three writes: one vectored write sends them, not three
    (each a TCP segment and a wake-up of the reader)."""
    import cleave.bus.send as send

    calls = []
    writev = send.os.writev
    monkeypatch.setattr(send.os, "writev", lambda fd, bufs: calls.append(len(bufs)) or writev(fd, bufs))
    peer = Peer()
    peer.reading.set()
    transport, sender, _ = await connect(await peer.start())
    pieces = [b"PUB tiles.w1 70000\r\n", bytes(range(256)) * 273 + bytes(112), b"\r\n"]
    try:
        for p in pieces:
            sender.write(p)
        assert not calls  # nothing sent while the writer still writes
        await asyncio.wait_for(sender.sent(), TIMEOUT_S)
        assert calls == [3]
        sender.close()
        await asyncio.wait_for(peer.ended.wait(), TIMEOUT_S)
        assert bytes(peer.got) == b"".join(pieces)
    finally:
        transport.abort()
        await peer.stop()
