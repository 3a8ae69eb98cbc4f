"""The dealing of GEMM tiles to a fleet (pure): `Dealer` decides, `model` holds what it reads and the
instructions it returns (`Send`, `ProveLink`, `WorkerLost`, `TilesLost`, `RecoveryDone`)."""

from cleave.gemm.dealer.core import Dealer
from cleave.gemm.dealer.model import (
    CHECK_BYTES,
    DEFAULT_CACHE_BYTES,
    JOINS_KEPT,
    BlockSend,
    Instruction,
    Member,
    Policy,
    ProveLink,
    Recovery,
    RecoveryDone,
    Send,
    TilesLost,
    Work,
    WorkerLost,
)

__all__ = ["CHECK_BYTES", "DEFAULT_CACHE_BYTES", "JOINS_KEPT", "BlockSend", "Dealer", "Instruction", "Member", "Policy",
           "ProveLink", "Recovery", "RecoveryDone", "Send", "TilesLost", "Work", "WorkerLost"]
