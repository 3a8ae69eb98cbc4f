"""A checkpoint as a byte stream: the raw bytes of each tensor, one after another, hashed chunk by chunk.

`Encoder` is a file-like reader that the Object Store's `put` pulls from: it reads the live tensors in
place, so no copy of the model is ever built, and it hashes every `chunk_bytes` of the stream (SHA-256).
Its `manifest()` (a small `CheckpointManifest`) names each tensor's key, dtype and shape and each chunk's
hash. `Decoder` is the writer `get` pushes into: it copies the bytes straight into their destinations (the
model's own parameters, fresh optimizer tensors) and checks each chunk's hash as soon as it is complete, so
a truncated or corrupted chunk raises `CorruptCheckpoint` naming the chunk. `read_checkpoint` streams a
committed one from the job's Object Store into a model (the PS resuming, an export).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog
import torch
from nats.js.errors import NotFoundError
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE
from torch import nn

from cleave import codec
from cleave.bus import DEFAULT_TIMEOUT_S
from cleave.errors import CleaveError, ConfigError, CorruptCheckpoint, WireError
from cleave.schemas import DTYPE_SIZES, MAX_MANIFEST_BYTES, CheckpointManifest, StateHead, TensorEntry

log = structlog.get_logger("cleave.checkpoint")
T = TypeVar("T")
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024  # hashed unit of the stream: a bad chunk is named, not just "bad"



@dataclass
class Snapshot:
    """The PS's state after `step`, by reference: the tensors are the model's and optimizer's own."""

    job: str
    step: int
    epoch: int
    tensors: dict[str, torch.Tensor]  # "model.<key>" and "opt.<param index>.<name>", in stream order
    optimizer_groups: list[dict]
    rng: torch.Tensor

    @property
    def nbytes(self) -> int:
        """The bytes its stream takes (the checkpoint's data object)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def snapshot(model: nn.Module, opt: torch.optim.Optimizer | None, job_id: str, step: int, epoch: int) -> Snapshot:
    """The model's weights, the optimizer's state and the RNG after `step`; nothing is copied."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    state = opt.state_dict() if opt is not None else {"state": {}, "param_groups": []}
    for idx, values in state["state"].items():
        for name, value in values.items():
            tensors[f"opt.{idx}.{name}"] = torch.as_tensor(value)
    return Snapshot(job_id, step, epoch, tensors, state["param_groups"], torch.get_rng_state())


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A byte view of a CPU tensor's storage (a copy only for a non-contiguous or non-CPU tensor)."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class _Chunks:
    """SHA-256 of each `size` bytes of a stream, fed in arbitrary pieces."""

    def __init__(self, size: int) -> None:
        self.size, self.done, self.fill = size, [], 0
        self.h = hashlib.sha256()

    def feed(self, data: memoryview, on_chunk: Callable[[int, str], None]) -> None:
        while len(data):
            take = min(len(data), self.size - self.fill)
            self.h.update(data[:take])
            self.fill, data = self.fill + take, data[take:]
            if self.fill == self.size:
                self.close(on_chunk)

    def close(self, on_chunk: Callable[[int, str], None]) -> None:
        if self.fill:
            digest = self.h.hexdigest()
            self.done.append(digest)
            on_chunk(len(self.done) - 1, digest)
            self.h, self.fill = hashlib.sha256(), 0


def _ignore(i: int, digest: str) -> None:
    pass


class Encoder(io.RawIOBase):
    """Reads a `Snapshot` as one stream; `on_read()` is called before every read but the first, i.e. once
    part of the stream is already out (fault injection: a PS killed mid-write)."""

    def __init__(self, snap: Snapshot, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 on_read: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.snap, self.chunks = snap, _Chunks(chunk_bytes)
        self.on_read = on_read or (lambda: None)
        self.entries = [TensorEntry(key=k, dtype=codec.dtype_name(v.dtype), shape=tuple(v.shape))
                        for k, v in snap.tensors.items()]
        self.pending = iter(snap.tensors.values())
        self.current, self.size = memoryview(b""), 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # noqa: ANN001 - any writable buffer
        if self.size:
            self.on_read()
        out, n = memoryview(b).cast("B"), 0
        while n < len(out):
            if not len(self.current):
                t = next(self.pending, None)
                if t is None:
                    break
                self.current = _bytes_of(t)
                continue
            take = min(len(out) - n, len(self.current))
            out[n:n + take] = self.current[:take]
            self.chunks.feed(self.current[:take], _ignore)
            self.current, n = self.current[take:], n + take
        self.size += n
        return n

    def manifest(self, data_object: str) -> CheckpointManifest:
        """What was streamed; call once the stream is exhausted."""
        self.chunks.close(_ignore)
        s = self.snap
        return CheckpointManifest(job=s.job, step=s.step, epoch=s.epoch, created_at=time.time(),
                                  data_object=data_object, size=self.size, chunk_bytes=self.chunks.size,
                                  chunk_sha256=tuple(self.chunks.done), tensors=tuple(self.entries),
                                  optimizer_groups=s.optimizer_groups, rng=codec.tensor_to_data(s.rng))


def targets(model: nn.Module, opt: torch.optim.Optimizer | None, m: CheckpointManifest,
            skip_optimizer: bool = False) -> list[torch.Tensor | None]:
    """Where each streamed tensor goes: the model's own tensors, fresh optimizer tensors, or None to skip.
    Key sets, shapes and dtypes are checked here, before any byte is copied."""
    own = model.state_dict()
    names = {e.key.removeprefix("model.") for e in m.tensors if e.key.startswith("model.")}
    if names != set(own):
        raise ConfigError(f"checkpoint of step {m.step} does not fit this model: keys {sorted(names ^ set(own))[:5]}")
    if not skip_optimizer and (opt is None) != (not m.optimizer_groups):
        raise ConfigError(f"checkpoint of step {m.step} does not fit this job's optimizer")
    out: list[torch.Tensor | None] = []
    for e in m.tensors:
        if e.key.startswith("model."):
            t = own[e.key.removeprefix("model.")]
            if tuple(t.shape) != e.shape or not codec.sendable(t.dtype) or codec.dtype_name(t.dtype) != e.dtype:
                raise ConfigError(f"checkpoint tensor {e.key} is {e.dtype}{list(e.shape)}, the model's "
                                  f"{t.dtype}{list(t.shape)}")
            staged = t.device.type != "cpu" or not t.is_contiguous()  # a CUDA PS: via host memory, one at a time
            out.append(torch.empty(e.shape, dtype=t.dtype) if staged else t)
        else:
            out.append(None if skip_optimizer else torch.empty(e.shape, dtype=codec.torch_dtype(e.dtype)))
    return out


class Decoder:
    """The writer a checkpoint stream is fed into; `finish()` checks that nothing is missing."""

    def __init__(self, m: CheckpointManifest, dests: list[torch.Tensor | None]) -> None:
        self.m, self.chunks = m, _Chunks(m.chunk_bytes)
        sizes = [math.prod(e.shape) * DTYPE_SIZES[e.dtype] for e in m.tensors]
        if sum(sizes) != m.size or len(m.chunk_sha256) != -(-m.size // m.chunk_bytes):
            raise CorruptCheckpoint(f"manifest of step {m.step} is inconsistent (sizes or chunk count)")
        self.views = [(memoryview(bytearray(n)) if d is None else _bytes_of(d)) if n else memoryview(b"")
                      for d, n in zip(dests, sizes, strict=True)]
        self.index, self.pos, self.received = 0, 0, 0

    def _check(self, i: int, digest: str) -> None:
        if digest != self.m.chunk_sha256[i]:
            raise CorruptCheckpoint(f"chunk {i} of checkpoint step {self.m.step} does not match its sha256")

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        if self.received + len(view) > self.m.size:
            raise CorruptCheckpoint(f"checkpoint of step {self.m.step} is longer than its manifest says")
        self.chunks.feed(view, self._check)
        self.received += len(view)
        while len(view):
            while self.pos == len(self.views[self.index]):
                self.index, self.pos = self.index + 1, 0
            dest = self.views[self.index]
            take = min(len(view), len(dest) - self.pos)
            dest[self.pos:self.pos + take] = view[:take]
            self.pos, view = self.pos + take, view[take:]
        return len(data)

    def finish(self) -> None:
        if self.received != self.m.size:
            raise CorruptCheckpoint(f"checkpoint of step {self.m.step} is truncated: {self.received} of "
                                    f"{self.m.size} bytes")
        self.chunks.close(self._check)


def apply(model: nn.Module, opt: torch.optim.Optimizer | None, m: CheckpointManifest,
          dests: list[torch.Tensor | None]) -> None:
    """After a verified stream: model tensors that were staged in host memory (a CUDA model) copied in,
    the optimizer's state from its fresh tensors, and the RNG."""
    own = model.state_dict()
    with torch.no_grad():
        for e, t in zip(m.tensors, dests, strict=True):
            target = own.get(e.key.removeprefix("model.")) if e.key.startswith("model.") else None
            if target is not None and t is not None and t.data_ptr() != target.data_ptr():
                target.copy_(t)
    if opt is not None and m.optimizer_groups:
        state: dict[int, dict[str, torch.Tensor]] = {}
        for e, t in zip(m.tensors, dests, strict=True):
            if e.key.startswith("opt.") and t is not None:
                _, idx, name = e.key.split(".", 2)
                state.setdefault(int(idx), {})[name] = t
        opt.load_state_dict({"state": state, "param_groups": m.optimizer_groups})
    torch.set_rng_state(codec.data_to_tensor(m.rng))


def restore(model: nn.Module, opt: torch.optim.Optimizer | None, stream: bytes, m: CheckpointManifest) -> None:
    """Load an in-memory stream (tests and tools; the PS streams from the Object Store instead)."""
    dests = targets(model, opt, m)
    dec = Decoder(m, dests)
    dec.write(stream)
    dec.finish()
    apply(model, opt, m, dests)


def encode(snap: Snapshot, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[bytes, CheckpointManifest]:
    """The whole stream in memory, and its manifest (tests and tools)."""
    enc = Encoder(snap, chunk_bytes)
    data = enc.read()
    return data, enc.manifest("memory")


DEFAULT_TRANSFER_TIMEOUT_S = 3600.0  # a whole streamed checkpoint (Llama3-1B with AdamW is ~16 GB)
TRANSFER_STALL_S = 60.0  # a checkpoint read that receives nothing this long is given up (its bytes stalled)
STALL_CHECK_S = 5.0  # a read that receives nothing this long asks the server whether it still has the next chunk


async def progressing(aw: Awaitable[T], progress: Callable[[], int], stall_s: float,
                      check: Callable[[], Awaitable[None]] | None = None, check_s: float | None = None) -> T:
    """`aw`'s result, or TimeoutError once `progress()` (a count that grows as it works) has not moved for
    `stall_s`: a long transfer gets as long as it keeps moving, a stalled one fails in `stall_s`. `check` is
    awaited every `check_s` (STALL_CHECK_S) that nothing moved; it raises to give up at once (what is awaited
    will never come)."""
    task = asyncio.ensure_future(aw)
    tick = min(stall_s, check_s or STALL_CHECK_S) if check else stall_s
    try:
        seen, still = -1, 0.0
        while True:
            done, _ = await asyncio.wait({task}, timeout=tick)
            if done:
                return task.result()
            if progress() != seen:
                seen, still = progress(), 0.0
                continue
            still += tick
            if still >= stall_s:
                raise TimeoutError
            if check:
                await check()
    finally:
        task.cancel()


async def lost_chunk(js, store, name: str, since: int) -> int | None:  # noqa: ANN001
    """The stream sequence of a chunk of object `name` (of `store`, on JetStream context `js`) after byte `since`
    that the server has lost (a damaged block of its disk: its consumer passes over the message and then waits,
    and asked for it, the server says it has none); None when it holds them all, or cannot tell (the object's
    chunks are not consecutive)."""
    info = await asyncio.wait_for(store.get_info(name), DEFAULT_TIMEOUT_S)
    stream = OBJ_STREAM_TEMPLATE.format(bucket=info.bucket)
    subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=info.bucket, obj=info.nuid)
    first = await asyncio.wait_for(js.get_msg(stream, 1, subject, next=True), DEFAULT_TIMEOUT_S)
    last = await asyncio.wait_for(js.get_last_msg(stream, subject), DEFAULT_TIMEOUT_S)
    if last.seq - first.seq + 1 != info.chunks:
        return None  # (else every sequence from the first chunk to the last is one of its chunks)
    for seq in range(first.seq + since // info.options.max_chunk_size, last.seq):
        try:
            await asyncio.wait_for(js.get_msg(stream, seq), DEFAULT_TIMEOUT_S)
        except NotFoundError:
            return seq
    return None


async def _not_lost(js, store, m: CheckpointManifest, dec: Decoder) -> None:  # noqa: ANN001
    """Raise CorruptCheckpoint if the server lost a chunk of `m`'s data not yet checked: one before the last
    whole hashed chunk received would have shifted the bytes after it and failed that chunk's check."""
    since = dec.received - dec.received % m.chunk_bytes
    try:
        seq = await lost_chunk(js, store, m.data_object, since)
    except Exception as e:  # (the question itself unanswered: the stall goes on counting)
        log.debug("checkpoint_chunk_unknown", object=m.data_object, error=type(e).__name__)
        return
    if seq is not None:
        raise CorruptCheckpoint(f"data {m.data_object} is damaged: the server lost one of its messages (stream "
                                f"sequence {seq}, after byte {since:,} of {m.size:,}; a damaged block of its store)")


async def read_checkpoint(js, store, head: StateHead, model: nn.Module,  # noqa: ANN001
                          opt: torch.optim.Optimizer | None, skip_optimizer: bool = False) -> CheckpointManifest:
    """Stream the checkpoint `head` names from `store` (an object store of JetStream context `js`) into `model`
    (in place) and `opt`; raises CleaveError when it is missing, truncated or corrupted (the model may then hold
    part of it: load another checkpoint)."""
    try:
        got = await asyncio.wait_for(store.get(head.object), DEFAULT_TIMEOUT_S)
    except Exception as e:
        raise CorruptCheckpoint(f"manifest {head.object} is unreadable ({type(e).__name__})") from None
    if hashlib.sha256(got.data).hexdigest() != head.sha256:
        raise CorruptCheckpoint(f"manifest {head.object} does not match its head record (sha256)")
    try:
        m = codec.decode(got.data, CheckpointManifest, MAX_MANIFEST_BYTES)
    except WireError as e:
        raise CorruptCheckpoint(f"manifest {head.object} is malformed: {e}") from None
    dests = targets(model, opt, m, skip_optimizer)
    dec = Decoder(m, dests)
    try:
        await progressing(store.get(m.data_object, writeinto=dec), lambda: dec.received, TRANSFER_STALL_S,
                          lambda: _not_lost(js, store, m, dec))
    except CleaveError:
        raise
    except TimeoutError:  # a chunk the server cannot deliver (a damaged block of its store) never comes
        raise CorruptCheckpoint(f"data {m.data_object} stalled: nothing arrived for {TRANSFER_STALL_S:.0f} s at byte "
                                f"{dec.received:,} of {m.size:,} (a damaged store?)") from None
    except Exception as e:  # nats-py: not found, or its own digest over the whole object
        raise CorruptCheckpoint(f"data {m.data_object} is unreadable ({type(e).__name__})") from None
    dec.finish()
    await asyncio.to_thread(apply, model, None if skip_optimizer else opt, m, dests)
    return m
