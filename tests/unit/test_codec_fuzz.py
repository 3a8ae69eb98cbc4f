"""Hostile bytes against the codec: `decode` and `Reassembler` may refuse (WireError) and nothing else.

Crashes: any other exception is a failure. Memory: a zstd bomb, a huge declared size or a cheap msgpack
body that inflates into millions of objects must be refused before the memory is taken; those checks
measure the decode's peak allocation with tracemalloc. The tests marked `xfail(strict=True)` show holes
that codec.py / schemas.py still have: each reason names the fix, and the marker goes when the fix lands
(strict: a fixed hole makes the test XPASS, which fails the run until the marker is removed).
"""

from __future__ import annotations

import contextlib
import math
import struct
import tracemalloc

import msgpack
import pytest
import zstandard
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cleave import codec
from cleave.errors import WireError
from cleave.schemas import (
    DTYPES,
    BlockRef,
    DeviceProfile,
    Event,
    GemmLayout,
    Heartbeat,
    Plan,
    PlanWorker,
    StepMetrics,
    TensorData,
    TileResult,
    TileTask,
)

pytestmark = pytest.mark.timeout(120)
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
SCHEMAS = (TileTask, TileResult, Heartbeat, Plan, Event, StepMetrics, TensorData)
HEAD = struct.Struct("<2sBB")
CHUNK = struct.Struct("<16sIIQ")
MiB = 1024 * 1024


def frame(body: bytes, flags: int = 0) -> bytes:
    return HEAD.pack(codec.MAGIC, codec.VERSION, flags) + body


def decode_or_refuse(payload: bytes, schema, max_bytes: int = codec.MAX_MESSAGE_BYTES):
    """The message, or None when refused with WireError; any other exception fails the test."""
    try:
        return codec.decode(payload, schema, max_bytes)
    except WireError:
        return None


def peak_bytes(fn) -> int:
    """Peak Python allocation while `fn()` runs (what a refusal must keep small)."""
    tracemalloc.start()
    try:
        fn()
    except WireError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def sample_messages() -> list:
    t = codec.tensor_to_data
    import torch

    profile = DeviceProfile(flops=1e9, memory_bytes=MiB, downlink_bytes_per_s=1e6, uplink_bytes_per_s=1e6,
                            latency_s=0.01)
    return [
        TileTask(job="j", epoch=1, step=2, op=3, tile=4, a=BlockRef(id="a", tensor=t(torch.ones(2, 3))),
                 b=BlockRef(id="b"), reply="cleave.result.j.1"),
        TileResult(job="j", epoch=1, step=2, op=3, tile=4, attempt=0, worker_id="w",
                   out=t(torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))),
        Heartbeat(worker_id="w-1", profile=profile, sent_at=1.0, started_at=0.5),
        Plan(version=1, created_at=1.0, workers=(PlanWorker(worker_id="w", profile=profile),), tile_rows=8,
             tile_cols=8),
        Plan(version=2, created_at=1.0, tile_rows=8, tile_cols=8,  # packed workers, boxes and owners
             workers=(PlanWorker(worker_id="w", profile=profile), PlanWorker(worker_id="v", profile=profile)),
             gemms=(GemmLayout(m=4, n=4, k=2, boxes=(0, 4, 0, 3, 0, 4, 3, 4), owners=("v", "w")),)),
        Event(kind="worker_lost", at=1.0, detail={"n": 1}),
    ]


SAMPLES = sample_messages()
leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                 st.text(max_size=20), st.binary(max_size=64))
values = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=6)),
                      max_leaves=30)


# ---- decode: crashes ---------------------------------------------------------------------------------
@FUZZ
@given(payload=st.binary(max_size=512), schema=st.sampled_from(SCHEMAS))
def test_random_bytes_are_refused_cleanly(payload: bytes, schema) -> None:
    decode_or_refuse(payload, schema)


@FUZZ
@given(flags=st.integers(0, 255), body=st.binary(max_size=512), schema=st.sampled_from(SCHEMAS))
def test_any_body_behind_a_valid_header(flags: int, body: bytes, schema) -> None:
    decode_or_refuse(frame(body, flags), schema)


@FUZZ
@given(body=st.binary(max_size=2048), schema=st.sampled_from(SCHEMAS))
def test_zstd_of_garbage(body: bytes, schema) -> None:
    decode_or_refuse(frame(zstandard.ZstdCompressor().compress(body), codec.FLAG_ZSTD), schema)


@FUZZ
@given(data=st.data())
def test_valid_messages_with_fields_replaced(data) -> None:
    msg = data.draw(st.sampled_from(SAMPLES))
    doc = msg.model_dump()
    for key in data.draw(st.lists(st.sampled_from(sorted(doc)), max_size=3)):
        doc[key] = data.draw(values)
    doc.update(data.draw(st.dictionaries(st.text(max_size=8), values, max_size=2)))  # unknown fields
    got = decode_or_refuse(frame(msgpack.packb(doc, use_bin_type=True)), type(msg))
    assert got is None or isinstance(got, type(msg))


@FUZZ
@given(data=st.data())
def test_valid_frames_with_bytes_flipped_or_cut(data) -> None:
    msg = data.draw(st.sampled_from(SAMPLES))
    raw = bytearray(codec.encode(msg, compress=data.draw(st.booleans())))
    for pos in data.draw(st.lists(st.integers(0, len(raw) - 1), max_size=4)):
        raw[pos] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(raw)))
    decode_or_refuse(bytes(raw[:cut]), type(msg))


def test_a_valid_message_round_trips() -> None:  # the fuzzers above would pass on a codec that refuses all
    for msg in SAMPLES:
        assert codec.decode(codec.encode(msg), type(msg)) == msg


# ---- decode: what validates is usable ----------------------------------------------------------------
dims = st.one_of(st.integers(0, 4), st.sampled_from([0, 2**31, 2**32, 2**62, 2**63, 2**64 - 1]))


@FUZZ
@given(dtype=st.sampled_from(DTYPES + ("complex64", "")), shape=st.lists(dims, max_size=9),
       extra=st.integers(-1, 1))
@example(dtype="float32", shape=[0, 2**63], extra=0)
def test_every_tensor_that_validates_converts(dtype: str, shape: list[int], extra: int) -> None:
    n = math.prod(shape) if len(shape) <= 8 and math.prod(shape) < 4096 else 1
    size = codec.DTYPE_SIZES.get(dtype, 1) * n + extra
    body = msgpack.packb({"dtype": dtype, "shape": shape, "data": b"\0" * max(size, 0)}, use_bin_type=True)
    got = decode_or_refuse(frame(body), TensorData)
    if got is not None:
        assert codec.data_to_tensor(got).numel() == math.prod(got.shape)


# ---- decode: memory ----------------------------------------------------------------------------------
def zstd_declaring(content_size: int, block: bytes = b"\x80" * 16) -> bytes:
    """A zstd frame whose header declares `content_size` bytes but which carries one small raw block."""
    fhd = 0xE0  # 8-byte frame content size, single segment
    block_header = (len(block) << 3 | 1).to_bytes(3, "little")  # raw block, last
    return b"\x28\xb5\x2f\xfd" + bytes([fhd]) + struct.pack("<Q", content_size) + block_header + block


@settings(FUZZ, max_examples=40)
@given(declared=st.integers(2 * MiB, 2**64 - 1))
@example(declared=100 * 1024**3)
@example(declared=1024**3)
def test_declared_zstd_size_is_refused_before_allocating(declared: int) -> None:
    payload = frame(zstd_declaring(declared), codec.FLAG_ZSTD)
    assert peak_bytes(lambda: codec.decode(payload, TileResult, max_bytes=MiB)) < 8 * MiB


def test_a_real_zstd_bomb_is_refused() -> None:
    bomb = frame(zstandard.ZstdCompressor().compress(b"\0" * (64 * MiB)), codec.FLAG_ZSTD)  # ~2 KiB
    assert len(bomb) < 64 * 1024
    with pytest.raises(WireError):
        codec.decode(bomb, TileResult, max_bytes=MiB)
    assert peak_bytes(lambda: codec.decode(bomb, TileResult, max_bytes=MiB)) < 8 * MiB


def test_msgpack_that_inflates_into_objects_is_refused() -> None:
    n = MiB
    body = b"\x81\xa3out" + b"\xdd" + struct.pack(">I", n) + b"\x90" * n  # {"out": [[], [], ...]}
    payload = frame(zstandard.ZstdCompressor().compress(body), codec.FLAG_ZSTD)
    assert len(payload) < 4096
    assert peak_bytes(lambda: codec.decode(payload, TileResult, max_bytes=2 * MiB)) < 32 * MiB


# ---- Reassembler -------------------------------------------------------------------------------------
def chunk(msg_id: bytes, idx: int, count: int, total: int, part: bytes, flags: int = 0) -> bytes:
    return HEAD.pack(codec.MAGIC, codec.VERSION, flags | codec.FLAG_CHUNK) + CHUNK.pack(msg_id, idx, count, total) + part


chunks = st.builds(chunk, msg_id=st.sampled_from([b"a" * 16, b"b" * 16, b"c" * 16]), idx=st.integers(0, 5),
                   count=st.integers(0, 6), total=st.one_of(st.integers(0, 64), st.just(2**64 - 1)),
                   part=st.binary(max_size=32), flags=st.integers(0, 255))


@FUZZ
@given(frames=st.lists(st.one_of(chunks, st.binary(max_size=40)), max_size=30))
def test_reassembler_takes_any_frame_sequence(frames: list[bytes]) -> None:
    r = codec.Reassembler(max_bytes=64, max_pending=2)
    for f in frames:
        try:
            whole = r.feed(f)
        except WireError:
            continue
        if whole is not None and whole[2] & codec.FLAG_CHUNK == 0 and f[3] & codec.FLAG_CHUNK:
            assert len(whole) <= 64 + HEAD.size
            decode_or_refuse(whole, TileResult, 64)


@FUZZ
@given(data=st.data(), size=st.integers(1, 4000), max_payload=st.integers(codec.CHUNK_OVERHEAD + 1, 600))
def test_reassembler_restores_split_frames_in_any_order(data, size: int, max_payload: int) -> None:
    whole = {i: frame(bytes([i]) * size, 0) for i in (1, 2)}
    parts = [p for w in whole.values() for p in codec.split(w, max_payload)]
    parts += data.draw(st.lists(st.sampled_from(parts), max_size=3))  # duplicates
    r, done = codec.Reassembler(max_bytes=8192), []
    for p in data.draw(st.permutations(parts)):
        out = r.feed(p)
        if out is not None:
            done.append(out)
    assert set(done) == set(whole.values())


def test_reassembler_holds_no_more_than_a_message_declares() -> None:
    r = codec.Reassembler(max_bytes=MiB)
    part = b"x" * 65536

    def flood() -> None:
        for i in range(40):
            with contextlib.suppress(WireError):
                r.feed(chunk(b"z" * 16, i, 41, 100, part))

    assert peak_bytes(flood) < 2 * MiB


def test_reassembler_pending_bytes_are_bounded_overall() -> None:
    r = codec.Reassembler(max_bytes=MiB, max_pending=64)
    half = b"y" * (MiB // 2)

    def flood() -> None:
        for i in range(64):
            r.feed(chunk(i.to_bytes(16, "little"), 0, 2, MiB, half))

    assert peak_bytes(flood) < 4 * MiB
