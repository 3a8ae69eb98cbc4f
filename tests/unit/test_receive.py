"""The parser that gathers large payloads in place (`cleave.bus.receive`) delivers what nats-py's own parser
delivers, whatever the boundaries of the socket's reads, and refuses a payload longer than its size."""

from __future__ import annotations

import random

import pytest
from nats.protocol.parser import Parser as NatsParser
from nats.protocol.parser import ProtocolError

from cleave.bus import receive


class Conn:
    """What a parser calls back: messages, pings and pongs, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    async def _process_msg(self, sid, subject, reply, payload, hdr) -> None:  # noqa: ANN001
        self.seen.append(("msg", sid, bytes(subject), bytes(reply), bytes(payload), hdr and bytes(hdr)))

    async def _process_ping(self) -> None:
        self.seen.append(("ping",))

    async def _process_pong(self) -> None:
        self.seen.append(("pong",))


def stream(rng: random.Random) -> bytes:
    """Small and large messages (below and above GATHER_BYTES), with and without a reply subject or headers,
    between pings and pongs; every payload different."""
    out = bytearray()
    for i in range(12):
        size = rng.choice([0, 5, receive.GATHER_BYTES - 1, receive.GATHER_BYTES, 3 * receive.GATHER_BYTES + 7])
        payload = rng.randbytes(size)
        if i % 5 == 4:
            hdr = b"NATS/1.0\r\nk: v\r\n\r\n"
            out += b"HMSG s.%d %d %d %d\r\n" % (i, i + 1, len(hdr), len(hdr) + size) + hdr + payload + b"\r\n"
        else:
            reply = b" _INBOX.r%d" % i if i % 3 == 0 else b""
            out += b"MSG s.%d %d%s %d\r\n" % (i, i + 1, reply, size) + payload + b"\r\n"
        out += rng.choice([b"", b"PING\r\n", b"PONG\r\n"])
    return bytes(out)


async def feed(parser_class: type, data: bytes, cuts: list[int]) -> list[tuple]:
    conn = Conn()
    parser = parser_class(conn)
    for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
        await parser.parse(data[a:b])
    return conn.seen


@pytest.mark.parametrize("seed", range(6))
async def test_same_messages_as_nats_py_whatever_the_reads(seed):
    rng = random.Random(seed)
    data = stream(rng)
    reads = [1, 7, 4096, 32768, 300_000]  # one byte at a time (near control lines) up to larger than a payload
    cuts, at = [], 0
    while True:
        at += rng.choice(reads)
        if at >= len(data):
            break
        cuts.append(at)
    want = await feed(NatsParser, data, cuts)
    assert len([s for s in want if s[0] == "msg"]) == 12
    assert await feed(receive.Parser, data, cuts) == want
    assert await feed(receive.Parser, data, []) == want  # all in one read


async def test_gathered_payload_is_the_message_data_without_a_copy():
    size = receive.GATHER_BYTES
    data = b"MSG big 1 %d\r\n" % size + bytes(range(256)) * (size // 256) + b"\r\n"
    got = []

    class Keep(Conn):
        async def _process_msg(self, sid, subject, reply, payload, hdr) -> None:  # noqa: ANN001
            got.append(payload)

    parser = receive.Parser(Keep())
    for i in range(0, len(data), 32768):
        await parser.parse(data[i : i + 32768])
    assert len(got) == 1 and isinstance(got[0], bytearray) and len(got[0]) == size
    assert got[0] == bytes(range(256)) * (size // 256)


async def test_payload_longer_than_its_size_is_a_protocol_error():
    size = receive.GATHER_BYTES
    data = b"MSG big 1 %d\r\n" % size + bytes(size) + b"xx\r\n"  # two bytes more than declared
    parser = receive.Parser(Conn())
    with pytest.raises(ProtocolError):
        for i in range(0, len(data), 32768):
            await parser.parse(data[i : i + 32768])



async def test_a_payload_still_viewed_when_whole_is_handed_on_as_a_copy_and_not_gathered_into_again():
    size = receive.GATHER_BYTES
    body = bytes(range(256)) * (size // 256)
    data = b"MSG big 1 %d\r\n" % size + body + b"\r\n"
    got = []

    class Keep(Conn):
        async def _process_msg(self, sid, subject, reply, payload, hdr) -> None:  # noqa: ANN001
            got.append(bytes(payload))

    parser = receive.Parser(Keep())
    await parser.parse(data[:1000])
    await parser.parse(data[1000:2000])
    held = memoryview(parser.payload)  # a view of the buffer being gathered, still alive when it is whole
    await parser.parse(data[2000:])
    assert got == [body]
    assert not any(s is held.obj for s in parser.spare)
    held.release()


async def test_an_unexpected_failure_while_parsing_is_a_protocol_error():
    """nats-py reconnects on a protocol error; on any other exception its read loop stops reading for good."""

    class Broken(Conn):
        async def _process_msg(self, sid, subject, reply, payload, hdr) -> None:  # noqa: ANN001
            raise RuntimeError("a bug")

    size = receive.GATHER_BYTES
    parser = receive.Parser(Broken())
    with pytest.raises(ProtocolError) as e:
        await parser.parse(b"MSG big 1 %d\r\n" % size + bytes(size) + b"\r\n")
    assert "a bug" in repr(e.value.__cause__)


async def test_a_payload_is_gathered_into_again_only_once_nothing_holds_it(monkeypatch):
    size = receive.GATHER_BYTES
    sizes = [size, size, size + 3, size - 5, 2 * size]  # a spare serves a payload of another size too
    bodies = [bytes([i]) * n for i, n in enumerate(sizes)]
    data = b"".join(b"MSG big 1 %d\r\n" % len(body) + body + b"\r\n" for body in bodies)
    got, held, new = [], [], []
    monkeypatch.setattr(receive, "bytearray", lambda n: new.append(n) or bytearray(n), raising=False)

    class Hold(Conn):
        async def _process_msg(self, sid, subject, reply, payload, hdr) -> None:  # noqa: ANN001
            got.append(bytes(payload))  # what it said when it came
            if not held:
                held.append(memoryview(payload))  # the first is still being read (as a decoded view would be)

    parser = receive.Parser(Hold())
    for i in range(0, len(data), 32768):
        await parser.parse(data[i : i + 32768])
    assert got == bodies
    assert bytes(held[0]) == bodies[0]  # the held one was never written over
    assert len(new) == 2  # the first two; the second, released, was gathered into by all that came after it


async def test_a_payload_is_gathered_into_the_shortest_spare_that_holds_it():
    """Cutting a long spare costs nothing; lengthening a short one copies: the spare that fits is taken."""
    size = receive.GATHER_BYTES
    sizes = [size, 2 * size, 2 * size, size, 3 * size]
    bodies = [bytes([i]) * n for i, n in enumerate(sizes)]
    data = b"".join(b"MSG big 1 %d\r\n" % len(body) + body + b"\r\n" for body in bodies)
    got, ids, held = [], [], []

    class Ids(Conn):
        async def _process_msg(self, sid, subject, reply, payload, hdr) -> None:  # noqa: ANN001
            got.append(bytes(payload))
            ids.append(id(payload))  # (the spares keep every one alive: ids are not reused)
            if len(got) == 1:
                held.append(memoryview(payload))  # the first is still read while the second comes: two spares
            elif held:
                held.pop().release()

    parser = receive.Parser(Ids())
    for i in range(0, len(data), 32768):
        await parser.parse(data[i : i + 32768])
    assert got == bodies
    assert ids[2] == ids[1]  # 2 x size: the long spare, not the first one lengthened
    assert ids[3] == ids[0]  # size: the shortest that holds it
    assert ids[4] == ids[1]  # 3 x size: none holds it; the longest is lengthened


async def test_a_subscription_that_takes_views_reads_payloads_where_they_were_gathered():
    """`hand_views`: a large payload of such a subscription is a read-only view of the buffer it was gathered
    in, and that buffer keeps its length, so payloads of any size up to it are all gathered into it (a buffer
    cut to less than half its length gives its memory back, and lengthening it again writes every byte); another
    subscription still gets a `bytearray` of the payload's size."""
    size = receive.GATHER_BYTES
    sids = [7, 7, 7, 7, 8]
    sizes = [3 * size, size, 2 * size, size + 1, size]
    bodies = [bytes([i]) * n for i, n in enumerate(sizes)]
    data = b"".join(b"MSG s %d %d\r\n" % (sid, len(body)) + body + b"\r\n" for sid, body in zip(sids, bodies, strict=True))
    got, buffers = [], []

    class Views(Conn):
        async def _process_msg(self, sid, subject, reply, payload, hdr) -> None:  # noqa: ANN001
            got.append(bytes(payload))
            if isinstance(payload, memoryview):
                assert payload.readonly and sid == 7
                buffers.append((id(payload.obj), len(payload.obj)))  # (the spare keeps it alive: ids not reused)
            else:
                assert type(payload) is bytearray and len(payload) == size and sid == 8

    parser = receive.Parser(Views())
    parser.views.add(7)
    for i in range(0, len(data), 32768):
        await parser.parse(data[i : i + 32768])
    assert got == bodies
    assert buffers == [buffers[0]] * 4 and buffers[0][1] == 3 * size + 2  # one buffer, never cut
