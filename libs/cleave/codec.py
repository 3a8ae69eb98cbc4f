"""The one wire codec: msgpack bodies, zstd only where it pays, tensors as (dtype, shape, bytes), chunking.

A frame is `MAGIC VERSION FLAGS` followed by either a whole body or, for a body larger than one NATS
message may carry, one chunk of it with `(message id, index, count, total length)`. `Reassembler` puts
chunks back together with bounded memory. Nothing here does I/O; `cleave.bus` sends what this builds.
"""

from __future__ import annotations

import functools
import os
import struct
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import msgpack
import numpy as np
import pydantic
import zstandard

from cleave.errors import TooLarge, WireError
from cleave.schemas import DTYPE_SIZES, DTYPES, MAX_MESSAGE_BYTES, TensorData, Wire

if TYPE_CHECKING:
    import torch

MAGIC = b"CV"
VERSION = 1
FLAG_ZSTD = 0x01
FLAG_CHUNK = 0x02
_HEAD = struct.Struct("<2sBB")  # magic, version, flags
_CHUNK = struct.Struct("<16sIIQ")  # message id, index, count, total body length
CHUNK_OVERHEAD = _HEAD.size + _CHUNK.size
_PLAIN_HEAD = _HEAD.pack(MAGIC, VERSION, 0)  # every byte below 0x80, a msgpack positive fixint (`encode`)
DEFAULT_ZSTD_MIN_BYTES = 4096  # smaller bodies are never worth compressing
DEFAULT_ZSTD_SAMPLE_BYTES = 65536
DEFAULT_ZSTD_MAX_RATIO = 0.85  # compress only when a sample shrinks to this fraction or less
DEFAULT_MAX_ITEMS = 1 << 18  # array and map entries in one message (a Plan for 10,000 workers has ~100k)
DEFAULT_MAX_STR = 64 * 1024  # no wire string is longer: ids, subjects, error texts
DEFAULT_PER_SENDER = 8  # partial chunked messages one sender (subject) may have at once (a worker uploads a few)
DEFAULT_PIECE_BYTES = 64 * 1024  # `encode_pieces`: a bytes value at least this long is a piece of its own
_BIN_HEADS = ((0xFF, struct.Struct(">BB"), 0xC4), (0xFFFF, struct.Struct(">BH"), 0xC5),
              (0xFFFFFFFF, struct.Struct(">BI"), 0xC6))  # msgpack's bin 8, 16 and 32 headers
_STAND_IN = struct.Struct("<12sI")  # `encode_pieces`: a random tag and the value's index

Piece = bytes | bytearray | memoryview  # one piece of a frame: `encode_pieces`, `split_pieces`

T = TypeVar("T", bound=Wire)

_local = threading.local()  # each thread's zstd compressor: one shared by a swarm's worker threads crashed it


def _zstd() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "zstd"):
        _local.zstd = zstandard.ZstdCompressor(level=1)
    return _local.zstd


# ---- tensors -----------------------------------------------------------------------------------------
# torch is imported by the first call that handles a tensor: the scheduler and the monitor never do, and start
# without it (its import is 2 s of CPU on a laptop core)
@functools.cache
def _torch_dtypes() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    import torch

    by_name = {name: getattr(torch, name) for name in DTYPES}  # the wire names are torch's own
    return by_name, {v: k for k, v in by_name.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name ("float32", "bfloat16", ...)."""
    return _torch_dtypes()[0][name]


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (KeyError for one the wire does not carry: `sendable` tells)."""
    return _torch_dtypes()[1][dtype]


def sendable(dtype: torch.dtype) -> bool:
    return dtype in _torch_dtypes()[1]


def numpy_dtype(name: str) -> np.dtype:
    """How numpy reads a wire dtype's bytes: its own type, or for bfloat16 (numpy has none) its bits as int16."""
    return np.dtype(np.int16) if name == "bfloat16" else np.dtype(name)


def tensor_to_data(t: torch.Tensor) -> TensorData:
    """A CPU tensor as wire data (one copy of its bytes; bf16 travels as its 16-bit pattern)."""
    name, shape, values = _wire_array(t)
    return TensorData.model_construct(dtype=name, shape=shape, data=values.tobytes())


def tensor_view(t: torch.Tensor) -> TensorData:
    """`tensor_to_data` over the tensor's own memory (a copy only when it is not contiguous): for a message
    encoded and sent before the tensor changes, whose bytes then go to the socket straight from the tensor."""
    name, shape, values = _wire_array(t)
    data = memoryview(values).cast("B")  # (the array, and so the tensor, lives as long as the view)
    return TensorData.model_construct(dtype=name, shape=shape, data=data)


def _wire_array(t: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    """The dtype name, shape and contiguous CPU values (bf16 as int16) of a tensor that may be sent."""
    import torch

    if not sendable(t.dtype):
        raise WireError("bad_dtype", f"cannot send tensors of {t.dtype}")
    t = t.detach().to("cpu").contiguous()
    view = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return dtype_name(t.dtype), tuple(t.shape), view.numpy()


def data_to_tensor(d: TensorData, pin: bool = False) -> torch.Tensor:
    """Wire data back to an owned, writable CPU tensor (TensorData has already checked the size): one copy of
    `data_view`; `pin`: in page-locked memory, for a non-blocking copy to a GPU (needs CUDA)."""
    import torch

    view = data_view(d)
    if not pin:
        return view.clone()
    return torch.empty(view.shape, dtype=view.dtype, pin_memory=True).copy_(view)


def data_view(d: TensorData) -> torch.Tensor:
    """Wire data as a CPU tensor over the message's own bytes, not a copy: for an input that is only read (a
    worker's tile blocks). Received bytes are immutable, so the tensor must never be written to; torch warns
    once about that (silenced here: the caller promises it)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(d.data, dtype=torch.int16 if d.dtype == "bfloat16" else torch_dtype(d.dtype)) \
            if len(d.data) else torch.empty(0, dtype=torch_dtype(d.dtype))
    return (t.view(torch.bfloat16) if d.dtype == "bfloat16" else t).reshape(d.shape)


def tensor_nbytes(d: TensorData) -> int:
    n = DTYPE_SIZES[d.dtype]
    for s in d.shape:
        n *= s
    return n


# ---- messages ----------------------------------------------------------------------------------------
def _pays(body: bytes) -> bool:
    """Whether zstd pays, judged on DEFAULT_ZSTD_SAMPLE_BYTES taken from four evenly spaced places (a
    message made of parts, such as a plan's random profiles next to its boxes, is judged as a whole)."""
    if len(body) < DEFAULT_ZSTD_MIN_BYTES:
        return False
    part = DEFAULT_ZSTD_SAMPLE_BYTES // 4
    step = (len(body) - part) // 3
    sample = body if len(body) <= DEFAULT_ZSTD_SAMPLE_BYTES else b"".join(body[i * step : i * step + part] for i in range(4))
    return len(_zstd().compress(sample)) <= DEFAULT_ZSTD_MAX_RATIO * len(sample)


def encode(msg: Wire, compress: bool = True) -> bytes:
    """A message as one frame body: msgpack, zstd-compressed when a sample shows it pays. The header and the
    body are packed into one buffer, so that a body of tensor bytes is not copied once more to put the header in
    front of it: each header byte is below 0x80, a msgpack positive fixint, which msgpack writes as that byte."""
    packer = msgpack.Packer(use_bin_type=True, autoreset=False)
    for byte in _PLAIN_HEAD:
        packer.pack(byte)
    packer.pack(msg.model_dump())
    if compress:
        body = packer.getbuffer()[_HEAD.size :]
        if _pays(body):
            return _HEAD.pack(MAGIC, VERSION, FLAG_ZSTD) + _zstd().compress(body)
    return packer.bytes()


def encode_pieces(msg: Wire, min_bytes: int = DEFAULT_PIECE_BYTES) -> list[Piece]:
    """`encode(msg, compress=False)` as pieces whose concatenation is that very frame, each bytes value of at
    least `min_bytes` (a tensor's data) a piece of its own, not copied: the bus writes the pieces one after
    the other, so a tile's blocks go from the bytes the PS made once per GEMM to the socket.

    The message is packed with a random 16-byte stand-in for each such value; each stand-in (16 bytes in
    msgpack's bin 8) is then replaced by the header msgpack writes for the value's length, and the value."""
    values: list[Piece] = []
    tag = os.urandom(12)
    tree = _stand_in(msg.model_dump(), values, tag, min_bytes)
    if not values:
        return [encode(msg, compress=False)]
    packer = msgpack.Packer(use_bin_type=True)
    packed = _PLAIN_HEAD + packer.pack(tree)
    found = sorted((packed.index(b"\xc4\x10" + _STAND_IN.pack(tag, i)), i) for i in range(len(values)))
    pieces: list[Piece] = []
    at = 0
    for pos, i in found:
        n = len(values[i])
        _, head, code = next(h for h in _BIN_HEADS if n <= h[0])
        pieces += [packed[at:pos] + head.pack(code, n), values[i]]
        at = pos + 2 + _STAND_IN.size
    pieces.append(packed[at:])
    return pieces


def _stand_in(obj: object, values: list[Piece], tag: bytes, min_bytes: int) -> object:
    """`encode_pieces`' tree with each bytes value of at least `min_bytes` moved to `values` and a stand-in in its
    place. (A function of the module, not a closure: a closure that calls itself is a reference cycle, which would
    keep `values`, a tensor's bytes, alive until the garbage collector's next pass.)"""
    if isinstance(obj, dict):
        return {k: _stand_in(v, values, tag, min_bytes) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_stand_in(v, values, tag, min_bytes) for v in obj]
    if isinstance(obj, bytes | bytearray | memoryview) and len(obj) >= min_bytes:
        values.append(obj)
        return _STAND_IN.pack(tag, len(values) - 1)
    return obj


def decode(payload: bytes | bytearray | memoryview, schema: type[T], max_bytes: int = MAX_MESSAGE_BYTES,
           compressed: bool = True) -> T:
    """Bytes from the wire to a validated message, or WireError; never anything half-checked. `compressed=False`
    refuses zstd bodies (`zstd_refused`): for messages that are dense floats, which never pay for it."""
    if len(payload) > max_bytes + _HEAD.size:
        raise TooLarge(f"{len(payload)} bytes over the limit of {max_bytes}")
    if len(payload) < _HEAD.size:
        raise WireError("truncated", f"{len(payload)} bytes")
    magic, version, flags = _HEAD.unpack_from(payload)
    if magic != MAGIC or version != VERSION:
        raise WireError("bad_magic", f"magic {magic!r} version {version}")
    if flags & FLAG_CHUNK:
        raise WireError("unexpected_chunk", "a chunk must go through a Reassembler first")
    body = memoryview(payload)[_HEAD.size :]
    if flags & FLAG_ZSTD:
        if not compressed:
            raise WireError("zstd_refused", "this message is never compressed")
        body = _decompress(body, max_bytes)
    budget = _Budget(DEFAULT_MAX_ITEMS)
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=DEFAULT_MAX_STR,
                              max_array_len=DEFAULT_MAX_ITEMS, max_map_len=DEFAULT_MAX_ITEMS, max_ext_len=0,
                              list_hook=budget.take, object_hook=budget.take)
    except WireError:
        raise
    except Exception as e:  # msgpack raises many types for garbage
        raise WireError("bad_msgpack", f"{type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise WireError("bad_schema", f"expected a map, got {type(obj).__name__}")
    try:
        return schema.model_validate(obj)
    except pydantic.ValidationError as e:
        raise WireError("bad_schema", f"{schema.__name__}: {e.error_count()} errors: {e.errors()[0]['msg']}") from None


def _decompress(body: memoryview, max_bytes: int) -> bytes:
    """zstd with the declared size checked first: decompress() allocates a declared size whatever max_output_size."""
    try:
        declared = zstandard.frame_content_size(body)  # -1 when the frame does not say
        if declared > max_bytes:
            raise TooLarge(f"zstd frame declares {declared} bytes, over the limit of {max_bytes}")
        out = zstandard.ZstdDecompressor().decompress(body, max_output_size=max_bytes)
    except zstandard.ZstdError as e:
        raise WireError("bad_zstd", str(e)) from None
    if len(out) > max_bytes:
        raise TooLarge(f"decompressed {len(out)} bytes over the limit of {max_bytes}")
    return out


class _Budget:
    """Counts the entries of every array and map msgpack builds: a small body must not inflate into millions."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def take(self, container):
        self.left -= len(container)
        if self.left < 0:
            raise TooLarge(f"more than {DEFAULT_MAX_ITEMS} array and map entries")
        return container


# ---- chunking ----------------------------------------------------------------------------------------
def split(frame: bytes, max_payload: int) -> list[bytes]:
    """One frame, or chunk frames each at most `max_payload` bytes including their own header."""
    if len(frame) <= max_payload:
        return [frame]
    room = max_payload - CHUNK_OVERHEAD
    if room <= 0:
        raise WireError("bad_limit", f"max_payload {max_payload} leaves no room for a chunk")
    _, _, flags = _HEAD.unpack_from(frame)
    body = memoryview(frame)[_HEAD.size :]
    count = -(-len(body) // room)
    msg_id = os.urandom(16)
    head = _HEAD.pack(MAGIC, VERSION, flags | FLAG_CHUNK)
    return [
        head + _CHUNK.pack(msg_id, i, count, len(body)) + body[i * room : (i + 1) * room]
        for i in range(count)
    ]


def split_pieces(pieces: list[Piece], max_payload: int) -> list[list[Piece]]:
    """`split` of the frame that `pieces` make, without joining them: each message as its pieces (slices of
    the large ones, not copies)."""
    total = sum(len(p) for p in pieces)
    if total <= max_payload:
        return [pieces]
    room = max_payload - CHUNK_OVERHEAD
    if room <= 0:
        raise WireError("bad_limit", f"max_payload {max_payload} leaves no room for a chunk")
    first = bytes(pieces[0][: _HEAD.size]) if len(pieces[0]) >= _HEAD.size else b"".join(pieces)[: _HEAD.size]
    _, _, flags = _HEAD.unpack_from(first)
    body, skip = [], _HEAD.size  # the pieces after the frame's own header, as memoryviews
    for p in pieces:
        view = memoryview(p)[skip:]
        skip = max(0, skip - len(p))
        if len(view):
            body.append(view)
    count = -(-(total - _HEAD.size) // room)
    msg_id = os.urandom(16)
    head = _HEAD.pack(MAGIC, VERSION, flags | FLAG_CHUNK)
    out: list[list[Piece]] = []
    for i in range(count):
        message: list[Piece] = [head + _CHUNK.pack(msg_id, i, count, total - _HEAD.size)]
        want = room
        while want and body:
            take = body[0][:want]
            message.append(take)
            want -= len(take)
            body[0] = body[0][len(take) :]
            if not len(body[0]):
                body.pop(0)
        out.append(message)
    return out


@dataclass
class _Partial:
    started: float
    count: int
    total: int
    flags: int
    parts: dict[int, memoryview] = field(default_factory=dict)
    held: int = 0  # bytes in parts


class Reassembler:
    """Collects chunk frames into whole frames, with bounded memory and a time limit per message.

    Partial messages are keyed by (sender, message id), `sender` being the subject the chunk came on: a chunk
    of one sender never completes, replaces or evicts another's message. A message may hold no more than the
    bytes it declares; one sender no more than `per_sender` partial messages and `per_sender_bytes` (its own
    oldest are given up first); all of them together no more than `max_pending` messages and `max_buffered`
    bytes (the oldest of the sender that holds the most are given up first).
    """

    def __init__(self, max_bytes: int = MAX_MESSAGE_BYTES, max_pending: int = 64, ttl_s: float = 30.0,
                 max_buffered: int | None = None, per_sender: int = DEFAULT_PER_SENDER,
                 per_sender_bytes: int | None = None) -> None:
        self.max_bytes, self.max_pending, self.ttl_s = max_bytes, max_pending, ttl_s
        self.max_buffered = 2 * max_bytes if max_buffered is None else max_buffered
        self.per_sender = per_sender
        self.per_sender_bytes = max_bytes if per_sender_bytes is None else per_sender_bytes
        self._pending: OrderedDict[tuple[str, bytes], _Partial] = OrderedDict()  # oldest first
        self._senders: dict[str, dict[bytes, None]] = {}  # sender -> its partial messages, oldest first
        self._held: dict[str, int] = {}  # sender -> bytes its partial messages hold
        self.buffered = 0  # bytes held by all partial messages
        self.dropped = 0  # partial messages given up (expired, evicted, inconsistent, oversized)

    def feed(self, frame: bytes, sender: str = "", max_bytes: int | None = None) -> bytes | None:
        """Returns a whole frame when `frame` completes one (or is one), else None; raises WireError.
        `max_bytes`: this message's limit when lower than the reassembler's own (what its sender can send)."""
        limit = self.max_bytes if max_bytes is None else min(max_bytes, self.max_bytes)
        if len(frame) < _HEAD.size:
            raise WireError("truncated", f"{len(frame)} bytes")
        magic, version, flags = _HEAD.unpack_from(frame)
        if magic != MAGIC or version != VERSION:
            raise WireError("bad_magic", f"magic {magic!r} version {version}")
        if not flags & FLAG_CHUNK:
            return frame
        if len(frame) < CHUNK_OVERHEAD:
            raise WireError("truncated", "chunk header")
        msg_id, idx, count, total = _CHUNK.unpack_from(frame, _HEAD.size)
        if total > limit:
            raise TooLarge(f"chunked message declares {total} bytes, over the limit of {limit}")
        if count == 0 or idx >= count or count > total + 1:
            raise WireError("bad_chunk", f"index {idx} of {count}")
        self._expire()
        key = (sender, msg_id)
        entry = self._pending.get(key)
        if entry is None:
            mine = self._senders.setdefault(sender, {})
            while len(mine) >= self.per_sender:
                self._drop((sender, next(iter(mine))))
            while len(self._pending) >= self.max_pending:
                self._drop(self._biggest())
            entry = self._pending[key] = _Partial(time.monotonic(), count, total, flags & ~FLAG_CHUNK)
            self._senders.setdefault(sender, {})[msg_id] = None
            self._held.setdefault(sender, 0)
        if (count, total) != (entry.count, entry.total):
            self._drop(key)
            raise WireError("bad_chunk", "chunks of one message disagree on count or size")
        part = memoryview(frame)[CHUNK_OVERHEAD:]  # not copied: the body is joined once, when whole
        grow = len(part) - len(entry.parts.get(idx, b""))
        if entry.held + grow > total:
            self._drop(key)
            raise TooLarge(f"chunks carry more than the {total} bytes their message declares")
        entry.parts[idx] = part
        entry.held += grow
        self.buffered += grow
        self._held[sender] += grow
        for other in [k for k in self._senders.get(sender, ()) if k != msg_id]:  # its own oldest first
            if self._held[sender] <= self.per_sender_bytes:
                break
            self._drop((sender, other))
        while self.buffered > self.max_buffered:
            victim = self._biggest(spare=key)
            if victim is None:
                break
            self._drop(victim)
        if len(entry.parts) < count:
            return None
        self._drop(key, given_up=False)
        if entry.held != total:
            self.dropped += 1
            raise WireError("bad_chunk", f"reassembled {entry.held} bytes, header said {total}")
        return b"".join([_HEAD.pack(MAGIC, VERSION, entry.flags), *(entry.parts[i] for i in range(count))])

    def _biggest(self, spare: tuple[str, bytes] | None = None) -> tuple[str, bytes] | None:
        """The oldest partial message of the sender holding the most bytes (not `spare`; None: only it is left)."""
        for sender in sorted(self._senders, key=lambda s: (-self._held.get(s, 0), -len(self._senders[s]))):
            for msg_id in self._senders[sender]:
                if (sender, msg_id) != spare:
                    return (sender, msg_id)
        return None

    def _drop(self, key: tuple[str, bytes], given_up: bool = True) -> None:
        entry = self._pending.pop(key)
        sender, msg_id = key
        self.buffered -= entry.held
        self._held[sender] -= entry.held
        mine = self._senders[sender]
        del mine[msg_id]
        if not mine:
            del self._senders[sender], self._held[sender]
        self.dropped += given_up

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            key, first = next(iter(self._pending.items()))
            if now - first.started <= self.ttl_s:
                break
            self._drop(key)
