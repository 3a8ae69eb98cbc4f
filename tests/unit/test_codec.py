"""The wire codec: round trips, chunking at the size limit, and refusal of malformed input."""

import gc
import subprocess
import sys
import weakref

import msgpack
import numpy as np
import pytest
import torch
import zstandard

from cleave import codec
from cleave.errors import TooLarge, WireError
from cleave.schemas import (
    BlockPart,
    BlockRef,
    Event,
    Heartbeat,
    JobSubmission,
    TensorData,
    TileResult,
    TileTask,
)


def result(t: torch.Tensor) -> TileResult:
    return TileResult(job="j", epoch=1, step=2, op=3, tile=4, attempt=0, worker_id="w", out=codec.tensor_to_data(t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8])
def test_tensor_round_trip_every_dtype(dtype):
    t = (torch.randn(7, 5) * 10).to(dtype)
    back = codec.data_to_tensor(codec.decode(codec.encode(result(t)), TileResult).out)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)
    back[0, 0] = 1  # owned and writable


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_a_received_tensor_is_read_where_the_message_holds_it(dtype):
    """`data_view`: the decoded bytes themselves as a tensor, equal to the sent one, not a copy of them."""
    t = (torch.randn(7, 5) * 10).to(dtype)
    got = codec.decode(codec.encode(result(t), compress=False), TileResult).out
    view = codec.data_view(got)
    assert view.dtype == dtype and torch.equal(view, t)
    assert view.data_ptr() == np.frombuffer(got.data, dtype=np.uint8).__array_interface__["data"][0]
    assert codec.data_view(codec.tensor_to_data(torch.empty(0, 3, dtype=dtype))).shape == (0, 3)


class Buffer(bytearray):
    """A tensor's bytes that can be watched (a weak reference) while a message is encoded over them."""


def test_pieces_of_a_message_hold_its_bytes_no_longer_than_they_live():
    """`encode_pieces` over the bytes of a tensor (`tensor_view` sends them from the tensor's own memory) makes
    no reference cycle: once the message and its pieces are dropped, the bytes are freed at once, not at the
    garbage collector's next pass (a worker's sent result of hundreds of MB stayed alive that long)."""
    data = Buffer(codec.DEFAULT_PIECE_BYTES)
    alive = weakref.ref(data)
    msg = TileResult.model_construct(**{**dict(result(torch.zeros(0))), "out": TensorData.model_construct(
        dtype="uint8", shape=(len(data),), data=data)})
    gc.collect()
    gc.disable()
    try:
        pieces = codec.encode_pieces(msg)
        assert any(p is data for p in pieces)  # sent as it is, not copied
        del pieces, msg, data
        assert alive() is None
    finally:
        gc.enable()


def test_nested_message_round_trip():
    task = TileTask(job="j", epoch=1, step=0, op=1, tile=2, a=BlockRef(id="a", tensor=codec.tensor_to_data(torch.ones(2, 3))),
                    b=BlockRef(id="b"), reply="r")
    back = codec.decode(codec.encode(task), TileTask)
    assert back == task


def test_zstd_only_where_it_pays():
    compressible = result(torch.zeros(256, 256))
    dense = result(torch.randn(256, 256))
    z, d = codec.encode(compressible), codec.encode(dense)
    assert z[3] & codec.FLAG_ZSTD and len(z) < 10_000
    assert not d[3] & codec.FLAG_ZSTD
    assert codec.decode(z, TileResult) == compressible


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_chunking_at_the_size_limit(extra):
    frame = codec.encode(result(torch.randn(64, 64)), compress=False)
    limit = len(frame) + extra
    parts = codec.split(frame, limit)
    assert all(len(p) <= limit for p in parts)
    assert len(parts) == (1 if extra >= 0 else 2)
    r = codec.Reassembler()
    outs = [r.feed(p) for p in parts]
    assert outs[:-1] == [None] * (len(parts) - 1) and outs[-1] == frame


def _tile(a_rows: int, b_rows: int, k: int) -> TileTask:
    part = BlockPart(id="b.0", tensor=codec.tensor_to_data(torch.randn(b_rows, k)))
    return TileTask(job="j", epoch=1, step=0, op=1, tile=2, a=BlockRef(id="a", tensor=codec.tensor_to_data(torch.randn(a_rows, k))),
                    b=BlockRef(id="b", parts=(part, BlockPart(id="b.1"), BlockPart(id="b.2", tensor=codec.tensor_to_data(torch.ones(1, k))))),
                    reply="r")


@pytest.mark.parametrize("shape", [(1, 1, 3), (64, 4, 256), (32, 32, 512), (1, 1, 16384), (1, 1, 16383), (300, 200, 300)])
def test_pieces_are_the_frame(shape):
    """`encode_pieces` makes `encode`'s very bytes (every bin header size: 8, 16 and 32 bits), its large values
    uncopied; `split_pieces` cuts them as `split` cuts the frame, chunk for chunk."""
    task = _tile(*shape)
    frame = codec.encode(task, compress=False)
    pieces = codec.encode_pieces(task, min_bytes=1024)
    assert b"".join(pieces) == frame
    big = [v.tensor.data for v in (task.a, *task.b.parts) if v.tensor is not None and len(v.tensor.data) >= 1024]
    assert [p for p in pieces if any(p is d for d in big)] == big
    for limit in (256, 4096, 65536, len(frame) - 1, len(frame)):
        whole, cut = codec.split(frame, limit), [b"".join(m) for m in codec.split_pieces(pieces, limit)]
        assert [len(c) for c in cut] == [len(w) for w in whole] and max(len(c) for c in cut) <= limit
        assert [c[:4] + c[20:] for c in cut] == [w[:4] + w[20:] for w in whole]  # all but the random message id
        r = codec.Reassembler()
        assert [r.feed(c) for c in cut][-1] == frame


def test_chunks_out_of_order_and_duplicated():
    frame = codec.encode(result(torch.randn(100, 100)), compress=False)
    parts = codec.split(frame, 4096)
    r = codec.Reassembler()
    order = list(reversed(parts[1:])) + [parts[1], parts[0]]
    outs = [r.feed(p) for p in order]
    assert outs[-1] == frame and all(o is None for o in outs[:-1])


def test_reassembler_bounds_memory_and_time():
    frame = codec.encode(result(torch.randn(100, 100)), compress=False)
    r = codec.Reassembler(max_bytes=1000)
    with pytest.raises(TooLarge):
        r.feed(codec.split(frame, 4096)[0])
    r = codec.Reassembler(max_pending=2, ttl_s=0.0)
    for _ in range(3):
        assert r.feed(codec.split(frame, 4096)[0]) is None
    assert r.dropped >= 1 and len(r._pending) <= 2


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"", "truncated"),
        (b"garbage bytes here", "bad_magic"),
        (b"CV\x01\x00" + b"\xc1\xc1", "bad_msgpack"),
        (b"CV\x01\x00" + msgpack.packb([1, 2, 3]), "bad_schema"),
        (b"CV\x01\x00" + msgpack.packb({"job": "j"}), "bad_schema"),
        (b"CV\x01\x01" + b"not zstd", "bad_zstd"),
    ],
)
def test_malformed_input_is_refused(payload, reason):
    with pytest.raises(WireError) as e:
        codec.decode(payload, TileResult)
    assert e.value.reason == reason


def test_declared_shape_must_match_the_bytes():
    bad = result(torch.ones(2, 2)).model_dump()
    bad["out"]["shape"] = (1 << 20, 1 << 20)
    with pytest.raises(WireError):
        codec.decode(b"CV\x01\x00" + msgpack.packb(bad), TileResult)
    with pytest.raises(Exception, match="elements"):
        TensorData(dtype="float32", shape=(1 << 20, 1 << 20), data=b"")


def test_zstd_bomb_is_refused_before_it_grows():
    bomb = b"CV\x01\x01" + zstandard.ZstdCompressor().compress(b"\x00" * (64 << 20))
    with pytest.raises(TooLarge):
        codec.decode(bomb, TileResult, max_bytes=1 << 20)


def test_oversized_frame_is_refused():
    with pytest.raises(TooLarge):
        codec.decode(b"CV\x01\x00" + b"x" * 2000, Event, max_bytes=1000)


def test_unknown_fields_are_ignored():
    hb = {"worker_id": "w1", "sent_at": 1.0, "started_at": 0.0, "from_the_future": 7,
          "profile": {"flops": 1e9, "memory_bytes": 10, "downlink_bytes_per_s": 1e6, "uplink_bytes_per_s": 1e6,
                      "latency_s": 0}}
    assert codec.decode(b"CV\x01\x00" + msgpack.packb(hb), Heartbeat).worker_id == "w1"


def test_a_sender_cannot_evict_or_complete_another_senders_message():
    """Reassembly is keyed by (subject, message id): 64 tiny chunk frames from one sender (each a new message)
    give up only that sender's own partial messages, never another's half-received result."""
    big = codec.encode(result(torch.randn(300, 300)), compress=False)
    parts = codec.split(big, 64 * 1024)
    r = codec.Reassembler(max_bytes=1 << 20, max_pending=64)
    assert r.feed(parts[0], "cleave.result.j.1.honest") is None
    for _ in range(64):
        spam = codec.split(codec.encode(result(torch.randn(20, 20)), compress=False), 256)[0]
        assert r.feed(spam, "cleave.result.j.1.attacker") is None
    assert len(r._senders["cleave.result.j.1.attacker"]) == codec.DEFAULT_PER_SENDER
    same_id = parts[1]  # the honest message's next chunk, replayed by the attacker on its own subject
    assert r.feed(same_id, "cleave.result.j.1.attacker") is None
    outs = [r.feed(p, "cleave.result.j.1.honest") for p in parts[1:]]
    assert outs[-1] == big and all(o is None for o in outs[:-1])


def test_results_may_refuse_zstd():
    frame = codec.encode(result(torch.zeros(64, 64)))  # zeros compress: a worker may be tempted
    assert frame[3] & codec.FLAG_ZSTD
    with pytest.raises(WireError, match="zstd_refused"):
        codec.decode(frame, TileResult, compressed=False)
    assert codec.decode(codec.encode(result(torch.zeros(64, 64)), compress=False), TileResult, compressed=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tensor_view_is_sent_from_the_tensor_itself(dtype):
    """`tensor_view`: the bytes of a contiguous tensor (a row block of a larger one) without a copy, encoded as
    `tensor_to_data`'s are; a transposed view is made contiguous first (one copy)."""
    big = torch.randn(64, 128).to(dtype)
    rows = big[8:40]
    d = codec.tensor_view(rows)
    assert d.data.nbytes == rows.numel() * rows.element_size()
    assert rows.view(torch.int16 if dtype == torch.bfloat16 else dtype).numpy().__array_interface__["data"][0] == \
        np.frombuffer(d.data, dtype=np.uint8).__array_interface__["data"][0]  # the tensor's own memory
    task = TileTask(job="j", epoch=1, step=0, op=1, tile=0, a=BlockRef(id="a", tensor=codec.tensor_to_data(rows)),
                    b=BlockRef(id="b"), reply="r")
    viewed = task.model_copy(update={"a": BlockRef.model_construct(id="a", tensor=d, fanout=False, parts=())})
    assert codec.encode(viewed, compress=False) == codec.encode(task, compress=False)
    assert b"".join(codec.encode_pieces(viewed, min_bytes=1024)) == codec.encode(task, compress=False)
    back = codec.decode(b"".join(codec.encode_pieces(viewed)), TileTask)
    assert torch.equal(codec.data_to_tensor(back.a.tensor), rows)
    t = big.t()[:16]  # not contiguous
    assert torch.equal(codec.data_to_tensor(codec.decode(codec.encode(
        task.model_copy(update={"a": BlockRef.model_construct(id="a", tensor=codec.tensor_view(t), fanout=False,
                                                              parts=())})), TileTask).a.tensor), t)


RACE = """
import sys, threading
import torch
from cleave import codec
from cleave.compression import get_compressor
from cleave.schemas import PackedTensors

none = get_compressor("none")
msgs = [PackedTensors(tensors={"w": none.compress(torch.full((500_000,), float(i)))}) for i in range(4)]
bad = []

def go(m):
    for _ in range(30):
        try:
            if codec.decode(codec.encode(m), PackedTensors) != m:
                bad.append("differs")
        except Exception as e:
            bad.append(repr(e))

threads = [threading.Thread(target=go, args=(m,)) for m in msgs]
[t.start() for t in threads]
[t.join() for t in threads]
print(len(bad), bad[:3])
"""


def test_threads_encode_at_once() -> None:
    """The workers of one `cleave swarm` process encode in threads at once: one zstd compressor shared by them
    crashed the process (a segmentation fault) or gave frames that did not decode."""
    done = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("0 "), (done.returncode, done.stdout, done.stderr[-500:])


@pytest.mark.parametrize("claimed", [True, "1700000000", b"1700000000", None])
def test_a_submissions_time_is_a_number_not_true_or_text(claimed):
    """`submitted_at: true` and `"1700000000"` were read as times (pydantic's lax mode); a number is one."""
    sub = {"job": "{}", "nonce": "a" * 16, "submitted_at": claimed}
    with pytest.raises(WireError) as e:
        codec.decode(b"CV\x01\x00" + msgpack.packb(sub), JobSubmission)
    assert e.value.reason == "bad_schema"
    for number in (1700000000, 1700000000.5):  # (an int is a number of seconds too)
        assert codec.decode(b"CV\x01\x00" + msgpack.packb({**sub, "submitted_at": number}),
                            JobSubmission).submitted_at == number
