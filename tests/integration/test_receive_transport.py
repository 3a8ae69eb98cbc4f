"""Cleave's connections read through `cleave.bus.receive.Transport` (the kernel reads a large payload straight
into the buffer it is gathered in): every message arrives exactly and in order from a real nats-server, small and
large, with and without headers, while the subscriber and its parser are slow (bytes queue, the socket is not
read for a while) and across a restart of the server; a large payload is read into its buffer directly. A flush
goes after the commands before it: once `flush()` returns, the server has the subscription."""

from __future__ import annotations

import asyncio
import random
import re

import nats
import pytest

from cleave.bus import receive

TIMEOUT_S = 60.0


def payloads(seed: int, count: int) -> list[tuple[bytes, dict | None]]:
    rng = random.Random(seed)
    sizes = [0, 3, 1000, receive.GATHER_BYTES - 1, receive.GATHER_BYTES, 900_000]
    return [(rng.randbytes(rng.choice(sizes)), {"k": str(i)} if i % 7 == 3 else None) for i in range(count)]


async def receive_all(nc, subject: str, want: int, slow_s: float = 0.0) -> tuple[list, asyncio.Event]:  # noqa: ANN001
    got: list = []
    done = asyncio.Event()

    async def on_msg(m) -> None:  # noqa: ANN001
        got.append((bytes(m.data), dict(m.headers) if m.headers else None))
        if slow_s:
            await asyncio.sleep(slow_s)  # (the next messages queue meanwhile)
        if len(got) == want:
            done.set()

    await nc.subscribe(subject, cb=on_msg, pending_bytes_limit=256 << 20)
    await nc.flush()
    return got, done


@pytest.mark.parametrize("slow_s", [0.0, 0.02])
async def test_every_message_arrives_exactly_and_in_order(nats_url, monkeypatch, slow_s):
    direct = []
    get_buffer = receive.Stream.get_buffer

    def spy(self, sizehint):  # noqa: ANN001, ANN202
        buf = get_buffer(self, sizehint)
        direct.append(self.direct)
        return buf

    monkeypatch.setattr(receive.Stream, "get_buffer", spy)
    if slow_s:  # the parser lets the loop run before it parses a piece: more bytes arrive meanwhile
        parse = receive.Parser.parse

        async def parse_later(self, data=b""):  # noqa: ANN001, ANN202
            await asyncio.sleep(0)
            await parse(self, data)

        monkeypatch.setattr(receive.Parser, "parse", parse_later)
    monkeypatch.setattr(receive, "QUEUED_BYTES", 2 * receive.GATHER_BYTES)  # the socket paused and resumed often
    sub = receive.client()
    await sub.connect(nats_url)
    pub = await nats.connect(nats_url)  # nats-py's own client sends
    try:
        sent = payloads(1, 60)
        got, done = await receive_all(sub, "rx.t", len(sent), slow_s)
        for data, headers in sent:
            await pub.publish("rx.t", data, headers=headers)
        await pub.flush()
        await asyncio.wait_for(done.wait(), TIMEOUT_S)
        assert got == sent
        assert not all(direct)
        if not slow_s:  # (a parser that lags behind finds bytes queued every time: they go first)
            assert any(direct)
    finally:
        await pub.close()
        await sub.close()


async def test_messages_arrive_after_the_server_restarts(nats_server):
    sub, back = receive.client(), asyncio.Event()

    async def reconnected() -> None:
        back.set()

    await sub.connect(nats_server.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1, reconnected_cb=reconnected)
    try:
        for round_ in range(2):
            if round_:
                nats_server.restart()
                await asyncio.wait_for(back.wait(), TIMEOUT_S)
            pub = await nats.connect(nats_server.url)
            try:  # (closed whatever happens: a socket left open fails whichever test the collector runs in)
                sent = payloads(2 + round_, 12)
                got, done = await receive_all(sub, f"rx.r{round_}", len(sent))
                for data, headers in sent:
                    await pub.publish(f"rx.r{round_}", data, headers=headers)
                await pub.flush()
                await asyncio.wait_for(done.wait(), TIMEOUT_S)
                assert got == sent, f"round {round_}: {len(got)} of {len(sent)} messages"
            finally:
                await pub.close()
    finally:
        await sub.close()


async def test_a_flush_returns_once_the_server_has_what_was_written_before_it(nats_url):
    sub = receive.client()
    await sub.connect(nats_url)
    pub = await nats.connect(nats_url)
    wire: list[bytes] = []
    try:
        transport = sub._transport
        write, writelines = transport.write, transport.writelines
        transport.write = lambda data: (wire.append(bytes(data)), write(data))[1]
        transport.writelines = lambda datas: (wire.extend(bytes(d) for d in datas), writelines(datas))[1]
        for i in range(20):
            got = asyncio.Event()

            async def on_msg(m, got=got) -> None:  # noqa: ANN001
                got.set()

            await sub.subscribe(f"order.{i}", cb=on_msg)
            await sub.flush()
            await pub.publish(f"order.{i}", b"x")  # (delivered only if the server had the SUB before the PONG)
            await asyncio.wait_for(got.wait(), TIMEOUT_S)
        assert re.findall(rb"^(SUB|PING)\b", b"".join(wire), re.M) == [b"SUB", b"PING"] * 20
    finally:
        await pub.close()
        await sub.close()


async def test_a_failure_while_parsing_reconnects_instead_of_leaving_the_connection_deaf(nats_url, monkeypatch):
    """nats-py's read loop stops for good on an exception other than a protocol error, leaving a connection that
    looks alive and reads nothing until its pings go unanswered (minutes); the parser turns every failure into a
    protocol error, so the client reconnects and messages arrive again within seconds."""
    parse, failed = receive.Parser._parse, []

    async def fail_once(self, data):  # noqa: ANN001, ANN202
        if not failed and len(data) > 1000:
            failed.append(True)
            raise RuntimeError("a bug while parsing")
        await parse(self, data)

    monkeypatch.setattr(receive.Parser, "_parse", fail_once)
    sub, back = receive.client(), asyncio.Event()

    async def reconnected() -> None:
        back.set()

    await sub.connect(nats_url, reconnect_time_wait=0.2, max_reconnect_attempts=-1, reconnected_cb=reconnected)
    pub = await nats.connect(nats_url)
    try:
        got: list[bytes] = []

        async def on_msg(m) -> None:  # noqa: ANN001
            got.append(bytes(m.data))

        await sub.subscribe("deaf.t", cb=on_msg)
        await sub.flush()
        await pub.publish("deaf.t", bytes(receive.GATHER_BYTES))  # the one whose parsing fails
        await pub.flush()
        await asyncio.wait_for(back.wait(), 10)
        deadline = asyncio.get_running_loop().time() + 10
        while b"after" not in got:  # (published until one arrives: those sent while it reconnected are lost)
            assert asyncio.get_running_loop().time() < deadline, "nothing arrived after the failure"
            await pub.publish("deaf.t", b"after")
            await pub.flush()
            await asyncio.sleep(0.1)
        assert failed
    finally:
        await pub.close()
        await sub.close()
