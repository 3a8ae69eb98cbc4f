"""A tile's journey on the wire: the task and its input blocks (whole, by id, as segments or fanned out), the fan-out
groups and link checks around it, and the result."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from cleave.schemas.base import TensorData, Wire
from cleave.schemas.limits import MAX_BLOCK_PARTS, MAX_LINKCHECK_BYTES
from cleave.schemas.subjects import MAX_WORKER_ID


class BlockPart(Wire):
    """One segment of a block's rows (`BlockRef.parts`)."""

    id: str = Field(max_length=256)
    tensor: TensorData | None = None
    fanout: bool = False


class BlockRef(Wire):
    """An input block of a tile: its id, and its data unless the worker already caches it or it comes on a
    fan-out subject (`fanout`: wait briefly for it before answering that it is missing); or, with `parts`,
    the blocks (segments of its rows, each as above) whose concatenation it is (`cleave.gemm.fanout.parts`)."""

    id: str = Field(max_length=256)
    tensor: TensorData | None = None
    fanout: bool = False
    parts: tuple[BlockPart, ...] = Field((), max_length=MAX_BLOCK_PARTS)



class BlockPush(Wire):
    """PS -> a fan-out group: one input block that several planned workers need, published once."""

    job: str
    epoch: int
    gemm: int
    block: BlockRef


class FanoutJoin(Wire):
    """PS -> one worker: subscribe to these fan-out subjects (and leave the job's others)."""

    job: str
    epoch: int
    version: int  # the plan they were made for
    subjects: tuple[str, ...] = Field((), max_length=4096)


class LinkCheck(Wire):
    """PS -> a worker that came back: a small round trip over the connection its tiles take, before any tile.
    Tiles of `job` and `epoch` sent before `sent_at` (PS clock) were given back when it left: it drops them."""

    job: str = ""
    epoch: int = 0
    sent_at: float = 0.0
    payload: bytes = Field(b"", max_length=MAX_LINKCHECK_BYTES)


class LinkCheckAck(Wire):
    worker_id: str = Field(min_length=1, max_length=MAX_WORKER_ID)


class FanoutAck(Wire):
    worker_id: str
    joined: tuple[str, ...] = Field((), max_length=4096)
    error: str = ""


class TileTask(Wire):
    """Compute out = a · btᵀ for one output block: a = A[r0:r1, :], bt = Bᵀ[c0:c1, :] (K never split)."""

    job: str
    epoch: int  # PS incarnation: results for an older epoch are fenced off
    step: int
    op: int  # GEMM sequence number within the step
    gemm: int = 0  # the GEMM run within the PS epoch (a step redone runs its GEMMs again): echoed in the result
    tile: int
    attempt: int = 0
    a: BlockRef
    b: BlockRef
    reply: str  # subject for the result
    sent_at: float = 0.0
    # the product's precision on the way back: "" float32; a bf16/fp16 job's GEMMs round it once, and the
    # worker rounding its block is the same rounding (and half the bytes)
    rounded: Literal["", "bfloat16", "float16"] = ""


class TileResult(Wire):
    job: str
    epoch: int
    step: int
    op: int
    gemm: int = 0  # the task's GEMM run: a result for any other run is dropped
    tile: int
    attempt: int
    worker_id: str
    out: TensorData | None = None
    missing: tuple[str, ...] = ()  # block ids the worker no longer caches: resend with data
    error: str = ""
    compute_s: float = 0.0
