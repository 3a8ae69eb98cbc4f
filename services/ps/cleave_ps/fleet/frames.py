"""The bytes of the dispatcher's messages: a dealt tile as the frames that carry it (its shared blocks
published to their fan-out group first, then the `TileTask`, each as pieces that leave the blocks' bytes
uncopied), and a result's block read back without a copy.

Each input block is encoded once per GEMM run (`GemmRun.blocks`) and shared by every worker that gets it;
a block that goes as its segments is a `BlockRef` of `BlockPart`s. numpy has no bfloat16: a bf16 block is
read as its bits (int16), and its finiteness from its exponent bits.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import torch

from cleave import codec
from cleave.codec import Piece
from cleave.gemm.dealer import BlockSend, Send
from cleave.schemas import SUBJECT_FANOUT, SUBJECT_TILES, BlockPart, BlockPush, BlockRef, TensorData, TileTask
from cleave_ps.fleet.runs import GemmRun

BF16_EXPONENT = 0x7F80  # all ones: an infinity or a NaN


def encode(job: str, epoch: int, run: GemmRun, s: Send, reply: str) -> list[tuple[str, str, list[Piece], Send | None]]:
    """(worker, subject, frame, the send or None for a fan-out push) for one dealt tile, each frame as its
    pieces (`codec.encode_pieces`: the blocks' bytes are not copied into it)."""
    out = []
    for blk, src in ((s.a, run.a), (s.b, run.bt)):
        for leaf in blk.leaves():
            if leaf.publish:
                push = BlockPush.model_construct(job=job, epoch=epoch, gemm=run.seq, block=ref(run, leaf, src, data=True))
                subject = SUBJECT_FANOUT.format(job=job, epoch=epoch, group=leaf.fanout)
                out.append((s.worker, subject, codec.encode_pieces(push), None))
    task = TileTask.model_construct(
        job=job, epoch=epoch, step=run.step, op=run.op, gemm=run.seq, tile=s.tile.index, attempt=s.attempt,
        a=ref(run, s.a, run.a), b=ref(run, s.b, run.bt), reply=reply, sent_at=time.time(), rounded=run.rounded,
    )
    out.append((s.worker, SUBJECT_TILES.format(worker_id=s.worker), codec.encode_pieces(task), s))
    return out


def copied(runs: Iterable[GemmRun]) -> int:
    """The bytes `encode` copies for these GEMM runs' blocks: none of a contiguous host input (its blocks are
    views of it), all of another."""
    return sum(t.nbytes for run in runs for t in (run.a, run.bt) if t.device.type != "cpu" or not t.is_contiguous())


def ref(run: GemmRun, blk: BlockSend, src: torch.Tensor, data: bool = False) -> BlockRef:
    """How a block is named in a message: its segments, its id alone (cached, or coming from its group), or
    with its bytes."""
    if blk.parts:
        refs = [ref(run, p, src) for p in blk.parts]
        parts = tuple(BlockPart.model_construct(id=r.id, tensor=r.tensor, fanout=r.fanout) for r in refs)
        return BlockRef.model_construct(id=blk.id, tensor=None, fanout=False, parts=parts)
    if not (blk.data or data):
        return BlockRef.model_construct(id=blk.id, tensor=None, fanout=bool(blk.fanout), parts=())
    tensor = run.blocks.get(blk.id)
    if tensor is None:
        tensor = run.blocks[blk.id] = codec.tensor_view(src[blk.lo : blk.hi])  # (sent within the GEMM run)
    return BlockRef.model_construct(id=blk.id, tensor=tensor, fanout=False, parts=())


def block(out: TensorData, rows: int, cols: int) -> np.ndarray:
    """A result's block over its message's bytes (read-only; a bf16 block as int16)."""
    return np.frombuffer(out.data, dtype=codec.numpy_dtype(out.dtype)).reshape(rows, cols)


def finite(values: np.ndarray, dtype: str) -> bool:
    """Whether every value of a result block is finite (a bfloat16 block is read as its bits)."""
    if dtype == "bfloat16":
        return bool(((values & BF16_EXPONENT) != BF16_EXPONENT).all())
    return bool(np.isfinite(values).all())
