"""Messages published as their pieces (`Bus.publish_pieces`: large ones written to the socket piece by piece,
`cleave.bus.direct`) arrive whole, in the order they were published, beside small ones nats-py queues itself."""

from __future__ import annotations

import asyncio

import torch

from cleave import bus as busmod
from cleave import codec
from cleave.bus import direct, send
from cleave.schemas import BlockRef, TileTask

TIMEOUT_S = 30.0


def task(tile: int, rows: int) -> TileTask:
    data = codec.tensor_to_data(torch.arange(rows * 256, dtype=torch.float32).reshape(rows, 256) + tile)
    return TileTask(job="j", epoch=1, step=0, op=1, tile=tile, a=BlockRef(id=f"a{tile}", tensor=data), b=BlockRef(id="b"),
                    reply="r")


async def test_pieces_arrive_whole_and_in_order(nats_url):
    # the subscriber first: a publisher connected before the subscription existed lost its first messages on a
    # loaded machine (plain nats-py and nats-server 2.15.1: 3 of 30 tries with two CPU hogs beside them, none
    # with the publisher connected after the subscription)
    sub = await busmod.connect(nats_url, "pieces-sub")
    got: list[TileTask] = []
    all_in = asyncio.Event()
    pub = None
    # a row is 1 KiB: below DIRECT_BYTES (nats-py publishes it), above it, and above the server's max_payload
    # (1 MiB by default: chunks, each written directly)
    rows = [1, 2 * direct.DIRECT_BYTES // 1024, 3 * sub.max_payload // 1024]
    sent = [task(i, rows[i % len(rows)]) for i in range(12)]

    async def on_task(msg: TileTask, nbytes: int) -> None:
        got.append(msg)
        if len(got) == len(sent):
            all_in.set()

    try:
        await sub.subscribe("pieces.t", TileTask, on_task, max_bytes=64 << 20)
        await sub.nc.flush()
        pub = await busmod.connect(nats_url, "pieces-pub")
        direct_before = pub.nc.stats["out_msgs"]
        through_nats_py: list[int] = []  # sizes of the messages nats-py published
        publish = pub.nc.publish

        async def spy(subject: str, payload: bytes = b"", **kw) -> None:
            through_nats_py.append(len(payload))
            await publish(subject, payload, **kw)

        pub.nc.publish = spy
        for t in sent:
            await pub.publish_pieces("pieces.t", codec.encode_pieces(t))
            if t.tile % 4 == 1:  # one that nats-py queues (its own path) just before a large one
                await pub.nc.publish("pieces.other", b"x")
        await asyncio.wait_for(all_in.wait(), TIMEOUT_S)
        assert [m.tile for m in got] == [t.tile for t in sent]
        assert got == sent
        assert pub.nc.stats["out_msgs"] > direct_before + len(sent)  # chunks counted as messages
        assert through_nats_py and max(through_nats_py) < direct.DIRECT_BYTES  # the large ones went directly
    finally:
        if pub is not None:
            await pub.close()
        await sub.close()


async def test_an_uncompressed_message_goes_out_with_its_tensor_data_uncopied(nats_url, monkeypatch):
    """`Bus.publish(..., compress=False)` (a worker's result) hands the bus the tensor's own bytes as a piece,
    the connection's sender queues those very bytes for the kernel (`send.Sender`: no copy in Python), and the
    message arrives equal, chunked or not."""
    written: list[object] = []  # what each write to the socket's sender is a view of
    write = send.Sender.write

    def spy_write(self, data) -> None:  # noqa: ANN001
        written.append(memoryview(data).obj)
        write(self, data)

    monkeypatch.setattr(send.Sender, "write", spy_write)
    sub = await busmod.connect(nats_url, "uncopied-sub")
    pub = await busmod.connect(nats_url, "uncopied-pub")
    got: list[TileTask] = []
    all_in = asyncio.Event()
    sent = [task(0, 2 * direct.DIRECT_BYTES // 1024), task(1, 3 * sub.max_payload // 1024)]
    handed: list[list] = []
    publish_pieces = pub.publish_pieces

    async def spy(subject: str, pieces: list) -> int:
        handed.append(pieces)
        return await publish_pieces(subject, pieces)

    async def on_task(msg: TileTask, nbytes: int) -> None:
        got.append(msg)
        if len(got) == len(sent):
            all_in.set()

    try:
        await sub.subscribe("uncopied.t", TileTask, on_task, max_bytes=64 << 20)
        await sub.nc.flush()
        pub.publish_pieces = spy
        for t in sent:
            await pub.publish("uncopied.t", t, compress=False)
        await asyncio.wait_for(all_in.wait(), TIMEOUT_S)
        assert got == sent
        assert pub.nc._transport.stream.sender is not None
        for t, pieces in zip(sent, handed, strict=True):
            assert any(p is t.a.tensor.data for p in pieces)  # the very bytes of the tensor, not a copy
            assert any(w is t.a.tensor.data for w in written)  # and so they went to the sender
    finally:
        await pub.close()
        await sub.close()


async def test_messages_written_without_waiting_arrive_in_order_and_leave_together(nats_url, monkeypatch):
    """`publish_pieces(wait=False)` returns once a message is written; `settled()` then sends it with the others
    written before it: one system call for all of them while the socket has room (the PS deals a GEMM's tiles so)."""
    sub = await busmod.connect(nats_url, "together-sub")
    got: list[TileTask] = []
    all_in = asyncio.Event()
    pub = None
    sent = [task(i, direct.DIRECT_BYTES // 1024 + 2) for i in range(3)]  # each written directly, ~200 KB in all

    async def on_task(msg: TileTask, nbytes: int) -> None:
        got.append(msg)
        if len(got) == len(sent):
            all_in.set()

    try:
        await sub.subscribe("together.t", TileTask, on_task, max_bytes=64 << 20)
        await sub.nc.flush()
        pub = await busmod.connect(nats_url, "together-pub")
        await pub.nc.flush()
        calls: list[int] = []
        writev = send.os.writev
        monkeypatch.setattr(send.os, "writev", lambda fd, bufs: calls.append(len(bufs)) or writev(fd, bufs))
        for t in sent:
            await pub.publish_pieces("together.t", codec.encode_pieces(t), wait=False)
        await pub.settled()
        assert calls and calls[0] == 3 * len(sent)  # PUB line, block, end of each: one writev
        await asyncio.wait_for(all_in.wait(), TIMEOUT_S)
        assert got == sent
    finally:
        if pub is not None:
            await pub.close()
        await sub.close()
