"""What the dispatcher keeps per GEMM in flight (`GemmRun`: its inputs, output, encoded blocks and pending
checks) and over the PS's life (`Counters`, what each step's metrics line reports)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from cleave.gemm.dealer import Recovery
from cleave.schemas import Event, TensorData
from cleave_ps.fleet.freivalds import Norms


@dataclass
class Counters:
    tiles: int = 0
    resent: int = 0
    dropped: int = 0
    rejected: int = 0
    cache_misses: int = 0
    copied: int = 0
    fenced: int = 0  # results for another GEMM run (of this step or an earlier one)
    verified: int = 0  # result blocks that passed Freivalds' check
    verify_cpu_s: float = 0.0  # CPU seconds those checks took (in worker threads or on the loop)
    bytes_down: int = 0
    bytes_up: int = 0
    gemm_s: float = 0.0  # wall time with distributed GEMMs in flight (overlapping ones counted once)
    planned_gemm_s: float = 0.0  # the plan's makespans of the GEMMs run
    unplanned: int = 0  # GEMMs run without a planned layout (dealt as a uniform grid)
    concurrent: int = 0  # the most GEMMs in flight at once
    recoveries: list[Event] = field(default_factory=list)


@dataclass
class Check:
    """A pending cross-worker check of one tile (`cleave_ps.fleet.verify`)."""

    tile: int
    attempt: int  # the verifying attempt
    first_worker: str
    verifier: str
    block: torch.Tensor  # the first worker's block


@dataclass
class GemmRun:
    seq: int
    step: int
    op: int
    name: str
    a: torch.Tensor  # as sent (cast to the tile dtype in the approximate mode)
    bt: torch.Tensor
    out: torch.Tensor
    done: asyncio.Event = field(default_factory=asyncio.Event)
    blocks: dict[str, TensorData] = field(default_factory=dict)  # encoded once, for every worker that needs it
    spoiled: str = ""  # a worker found lying during this GEMM
    checks: dict[int, Check] = field(default_factory=dict)  # tile -> its pending verification
    expected_s: float = 0.0  # the plan's makespan for this GEMM (0: no prediction)
    rounded: str = ""  # the precision its blocks come back in ("": float32; `TileTask.rounded`)
    bytes_down: int = 0  # what the PS published for it (tiles and fan-out blocks)
    strips: tuple[tuple[int, int], ...] = ()  # the column ranges of its tiles
    norms: Norms | None = None  # its inputs' row norms, for Freivalds' checks (`examine.prepare`)

    def __post_init__(self) -> None:
        self.norms = Norms(self.a, self.bt, self.strips)


def recovery_event(rec: Recovery, run: GemmRun | None) -> Event:
    """A loss made good, as the `recovered` event of its step's metrics line."""
    return Event(
        kind="recovered", at=time.time(), step=run.step if run else None, worker_id=rec.worker, cause=rec.cause,
        detect_s=rec.detected_at - rec.silent_since,
        redispatch_s=(rec.redispatched_at or rec.done_at) - rec.detected_at,
        complete_s=rec.done_at - rec.detected_at, detail={"gemm": run.name if run else ""},
    )
