"""A msgpack body unpacked with its large bin values as views (`cleave.bins`, `codec.decode(views=True)`) is the
same value msgpack unpacks, whatever the body; each large bin is a read-only view of the body's own bytes; hostile
bodies are refused exactly as without views, and a forged stand-in is never taken for one."""

from __future__ import annotations

import functools
import os
import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cleave import bins, codec
from cleave.errors import WireError
from cleave.schemas import TileResult, TileTask

FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
MIN = 8  # bins of this many bytes or more are views in these tests
unpackb = functools.partial(msgpack.unpackb, raw=False, strict_map_key=True)

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
           | st.floats(width=32, allow_nan=False) | st.text(max_size=40) | st.binary(max_size=40)
           | st.binary(min_size=200, max_size=70_000))  # (bin 8, 16 and 32 heads; str 8 and 16)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=10), inner,
                                                                                            max_size=20), max_leaves=60)


def plain(obj: object) -> object:
    """`obj` with every view as bytes, to compare with what msgpack unpacks."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    return bytes(obj) if isinstance(obj, memoryview) else obj


def views_of(obj: object) -> list[memoryview]:
    if isinstance(obj, dict):
        return [v for x in obj.values() for v in views_of(x)]
    if isinstance(obj, list):
        return [v for x in obj for v in views_of(x)]
    return [obj] if isinstance(obj, memoryview) else []


def large_bins(obj: object) -> int:
    if isinstance(obj, dict):
        return sum(large_bins(v) for v in obj.values())
    if isinstance(obj, list):
        return sum(large_bins(v) for v in obj)
    return isinstance(obj, bytes) and len(obj) >= MIN


@FUZZ
@given(values)
def test_every_value_unpacks_as_msgpack_unpacks_it_each_large_bin_a_view_of_the_body(obj):
    body = bytearray(msgpack.packb(obj, use_bin_type=True))
    got = bins.unpack(memoryview(body), MIN, unpackb)
    assert plain(got) == unpackb(body)
    views = views_of(got)
    assert len(views) == large_bins(obj)
    assert all(v.readonly and v.obj is body for v in views)  # the body's own bytes: not copied


@FUZZ
@given(values, st.data())
def test_a_damaged_body_is_unpacked_or_refused_as_msgpack_would(obj, data):
    body = bytearray(msgpack.packb(obj, use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 4))):
        cut = data.draw(st.integers(0, len(body)))
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip" and cut < len(body):
            body[cut] ^= data.draw(st.integers(1, 255))
        elif action == "cut":
            del body[cut:]
        else:
            body[cut:cut] = data.draw(st.binary(min_size=1, max_size=6))
    try:
        want = unpackb(bytes(body))
    except Exception as e:  # (msgpack's many error types)
        with pytest.raises(type(e)):
            bins.unpack(memoryview(body), MIN, unpackb)
    else:
        assert plain(bins.unpack(memoryview(body), MIN, unpackb)) == want


def test_a_forged_stand_in_stays_what_it_is():
    """A sender cannot guess the stand-in of a decode: a 16-byte bin shaped like one comes back as it was sent."""
    forged = struct.pack("<12sI", os.urandom(12), 0)
    obj = {"a": forged, "b": bytes(range(100)), "c": [forged]}
    got = bins.unpack(memoryview(msgpack.packb(obj, use_bin_type=True)), 64, unpackb)
    assert plain(got) == obj and isinstance(got["a"], bytes) and isinstance(got["b"], memoryview)


def test_a_body_too_long_to_walk_is_unpacked_whole():
    obj = {"many": list(range(bins.MAX_WALKED)), "data": bytes(1000)}
    body = msgpack.packb(obj, use_bin_type=True)
    assert bins.find(memoryview(body), MIN) is None
    got = bins.unpack(memoryview(body), MIN, unpackb)
    assert got == obj and isinstance(got["data"], bytes)  # copied by msgpack, as without views


def result(out: torch.Tensor) -> TileResult:
    return TileResult(job="j", epoch=1, step=2, op=0, gemm=3, tile=4, attempt=0, worker_id="w",
                      out=codec.tensor_view(out), compute_s=0.1)


def test_a_decoded_result_block_is_the_received_buffer_itself():
    out = torch.randn(512, 256)
    payload = bytearray(b"".join(bytes(p) for p in codec.encode_pieces(result(out))))
    msg = codec.decode(payload, TileResult, 64 << 20, compressed=False, views=True)
    assert msg == codec.decode(bytes(payload), TileResult, 64 << 20, compressed=False).model_copy(
        update={"out": msg.out})
    assert isinstance(msg.out.data, memoryview) and msg.out.data.obj is payload and msg.out.data.readonly
    assert np.array_equal(np.frombuffer(msg.out.data, dtype=np.float32).reshape(512, 256), out.numpy())
    assert bytes(codec.encode(msg, compress=False)) == bytes(payload)  # it packs back to the same frame


def test_views_change_no_refusal():
    """A block whose size disagrees with its shape, or a body over the limit, is refused with views too."""
    good = b"".join(bytes(p) for p in codec.encode_pieces(result(torch.randn(64, 64))))
    bad = good.replace(b"\xa5shape\x92\x40\x40", b"\xa5shape\x92\x40\x41")  # shape 64x65
    assert bad != good
    for views in (False, True):
        with pytest.raises(WireError, match="bad_schema"):
            codec.decode(bad, TileResult, 64 << 20, compressed=False, views=views)
        with pytest.raises(WireError):
            codec.decode(good, TileResult, 1000, compressed=False, views=views)
        with pytest.raises(WireError, match="bad_schema"):  # a result is not a task
            codec.decode(good, TileTask, 64 << 20, compressed=False, views=views)
