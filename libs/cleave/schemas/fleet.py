"""What devices tell about themselves: profiles, heartbeats, link probes and registry entries."""

from __future__ import annotations

from pydantic import Field

from cleave.schemas.base import Wire
from cleave.schemas.limits import MAX_PROBE_BYTES


class DeviceProfile(Wire):
    """What a device offers, measured at registration or declared for an emulated fleet."""

    flops: float = Field(gt=0)  # sustained GEMM FLOP/s
    memory_bytes: int = Field(gt=0)  # budget for input blocks and the output block of one tile
    downlink_bytes_per_s: float = Field(gt=0)
    uplink_bytes_per_s: float = Field(gt=0)
    latency_s: float = Field(ge=0)
    declared: bool = False  # True when the worker paces itself to honour a declared profile


class Probe(Wire):
    """A link probe: `payload` carries the upload; the echo carries `reply_bytes` back down."""

    payload: bytes = Field(b"", max_length=MAX_PROBE_BYTES)
    reply_bytes: int = Field(0, ge=0, le=MAX_PROBE_BYTES)


class Heartbeat(Wire):
    worker_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    profile: DeviceProfile
    sent_at: float
    started_at: float
    cache_bytes: int = 0
    tiles_done: int = 0
    busy_s: float = 0.0


class DeviceRecord(Wire):
    """A registry entry (JetStream KV), written by the scheduler from heartbeats."""

    worker_id: str
    profile: DeviceProfile
    first_seen: float
    last_seen: float
    cache_bytes: int = 0
    tiles_done: int = 0
