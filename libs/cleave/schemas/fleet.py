"""What devices tell about themselves: profiles, heartbeats, link probes and registry entries."""

from __future__ import annotations

from pydantic import Field

from cleave.schemas.base import Wire
from cleave.schemas.limits import MAX_PROBE_BYTES, MAX_ROUND_WORKERS
from cleave.schemas.subjects import WORKER_ID_PATTERN

MAX_OBSERVED_WORKERS = MAX_ROUND_WORKERS  # workers in one `Observed` report
MAX_PROBE_RETRY_S = 60.0  # the longest a refused probe is told to wait


# The range a profile's fields must lie in (a profile outside is refused where it is decoded): finite, and
# wide enough for any real device and for the simulator's idealised ones, narrow enough that no claim makes
# the cost model's arithmetic overflow or keeps a silent worker registered for long (`liveness_limit`).
MIN_FLOPS, MAX_FLOPS = 1e6, 1e18  # FLOP/s: a microcontroller .. a whole rack
MIN_BANDWIDTH, MAX_BANDWIDTH = 1e3, 1e15  # bytes/s: a modem .. a link that costs nothing
MAX_LATENCY_S = 10.0  # one way, seconds
MAX_MEMORY_BYTES = 1 << 50  # 1 PiB


class DeviceProfile(Wire):
    """What a device offers, measured at registration or declared for an emulated fleet (finite, bounded)."""

    flops: float = Field(ge=MIN_FLOPS, le=MAX_FLOPS, allow_inf_nan=False)  # sustained GEMM FLOP/s
    memory_bytes: int = Field(gt=0, le=MAX_MEMORY_BYTES)  # budget for input blocks and the output block of one tile
    downlink_bytes_per_s: float = Field(ge=MIN_BANDWIDTH, le=MAX_BANDWIDTH, allow_inf_nan=False)
    uplink_bytes_per_s: float = Field(ge=MIN_BANDWIDTH, le=MAX_BANDWIDTH, allow_inf_nan=False)
    latency_s: float = Field(ge=0, le=MAX_LATENCY_S, allow_inf_nan=False)
    declared: bool = False  # True when the worker paces itself to honour a declared profile

    @classmethod
    def within(cls, **values: float | bool) -> DeviceProfile:
        """A profile from measured (finite) values, each brought into the range a profile must lie in."""
        for name, value in values.items():
            for rule in cls.model_fields[name].metadata:
                low, high = getattr(rule, "ge", None), getattr(rule, "le", None)
                value = value if low is None else max(value, low)
                value = value if high is None else min(value, high)
            values[name] = value
        return cls(**values)


class Probe(Wire):
    """A link probe: `payload` carries the upload; the echo carries `reply_bytes` back down. An answer with
    `retry_after_s` is no echo but a refusal (the echo budget is spent): ask again after that long. Only a
    probe that is `refusable` gets one; an older worker would take any answer for its echo, so past the budget
    its probes go unanswered (it then measures a slow link, never a fast one)."""

    payload: bytes = Field(b"", max_length=MAX_PROBE_BYTES)
    reply_bytes: int = Field(0, ge=0, le=MAX_PROBE_BYTES)
    refusable: bool = False  # in a probe: its sender waits and asks again when refused
    retry_after_s: float = Field(0.0, ge=0, le=MAX_PROBE_RETRY_S, allow_inf_nan=False)  # in an answer: refused


class Heartbeat(Wire):
    worker_id: str = Field(pattern=WORKER_ID_PATTERN)
    profile: DeviceProfile
    sent_at: float = Field(allow_inf_nan=False)
    started_at: float = Field(allow_inf_nan=False)
    cache_bytes: int = Field(0, ge=0, le=MAX_MEMORY_BYTES)
    tiles_done: int = Field(0, ge=0)
    busy_s: float = Field(0.0, ge=0, allow_inf_nan=False)


class DeviceRecord(Wire):
    """A registry entry (JetStream KV), written by the scheduler from heartbeats."""

    worker_id: str
    profile: DeviceProfile
    first_seen: float
    last_seen: float
    cache_bytes: int = 0
    tiles_done: int = 0


class WorkerObserved(Wire):
    """What one worker delivered, as the PS saw it: the seconds its accepted tiles kept it busy, and what the
    cost model on the profile it was planned with predicted for them."""

    worker_id: str = Field(pattern=WORKER_ID_PATTERN)
    tiles: int = Field(ge=1)
    observed_s: float = Field(ge=0, allow_inf_nan=False)
    predicted_s: float = Field(gt=0, allow_inf_nan=False)
    flops: float = Field(ge=MIN_FLOPS, le=MAX_FLOPS, allow_inf_nan=False)  # of the profile it was planned with


class Observed(Wire):
    """PS -> scheduler (`SUBJECT_OBSERVED`): the workers' delivered throughput since the last report; the
    scheduler corrects a profile that claims far more than its worker delivers."""

    job: str = Field(max_length=256)
    at: float = Field(allow_inf_nan=False)
    workers: tuple[WorkerObserved, ...] = Field((), max_length=MAX_OBSERVED_WORKERS)
