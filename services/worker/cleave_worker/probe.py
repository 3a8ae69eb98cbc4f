"""Measure this worker's links to the hub over NATS: latency (64 B echo), uplink and downlink (4 MiB)."""

from __future__ import annotations

import time

from cleave.bus import Bus
from cleave.schemas import MAX_PROBE_BYTES, SUBJECT_PROBE, Probe

DEFAULT_PROBE_TIMEOUT_S = 10.0
PROBE_HEADROOM = 1024  # the probe and its echo stay one NATS message each


async def _echo(bus: Bus, probe: Probe) -> float:
    start = time.perf_counter()
    await bus.request(SUBJECT_PROBE, probe, Probe, DEFAULT_PROBE_TIMEOUT_S, MAX_PROBE_BYTES + 1024)
    return time.perf_counter() - start


async def measure_links(bus: Bus) -> tuple[float, float, float]:
    """(downlink bytes/s, uplink bytes/s, one-way latency s), best of a few tries each."""
    size = min(MAX_PROBE_BYTES, bus.max_payload - PROBE_HEADROOM)
    rtt = min([await _echo(bus, Probe()) for _ in range(3)])
    up = min([await _echo(bus, Probe(payload=bytes(size))) for _ in range(2)])
    down = min([await _echo(bus, Probe(reply_bytes=size)) for _ in range(2)])
    return size / max(down - rtt, 1e-6), size / max(up - rtt, 1e-6), rtt / 2
