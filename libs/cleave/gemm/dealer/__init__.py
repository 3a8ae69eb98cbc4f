"""The dealing of GEMM tiles to a fleet (pure): `Dealer` decides, `model` holds what it reads and returns."""

from cleave.gemm.dealer.core import Dealer
from cleave.gemm.dealer.model import (
    CHECK_BYTES,
    DEFAULT_CACHE_BYTES,
    JOINS_KEPT,
    BlockSend,
    Member,
    Policy,
    Recovery,
    Send,
    Work,
)

__all__ = ["CHECK_BYTES", "DEFAULT_CACHE_BYTES", "JOINS_KEPT", "BlockSend", "Dealer", "Member", "Policy", "Recovery", "Send", "Work"]
