"""Measure this worker's links to the hub over NATS: latency (64 B echo), then uplink and downlink with
probes that start small and grow until one transfer takes PROBE_TARGET_S (or reaches the largest size).

A probe that times out proves only that the link is no faster than its bytes over the time waited: that
bound is what it reports, never a default. When not even the small echo comes back (no scheduler yet, or
the link is down) `ProbeFailed` is raised and the worker stays out of the fleet until a probe succeeds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from cleave.bus import Bus
from cleave.errors import ProbeFailed
from cleave.schemas import MAX_PROBE_BYTES, SUBJECT_PROBE_FROM, Probe

DEFAULT_PROBE_TIMEOUT_S = 5.0  # one echo; past it the probe yields its bound
FIRST_PROBE_BYTES = 64 * 1024  # a 0.1 MB/s link moves it in under a second
PROBE_GROWTH = 4  # each probe this many times the last
PROBE_TARGET_S = 0.2  # long enough that latency and a shaper's first burst (~1/100 s of its rate) barely count
PROBE_HEADROOM = 1024  # the probe and its echo stay one NATS message each



@dataclass(frozen=True)
class Links:
    """What the probes proved. `bounded`: a probe timed out, so a rate is an upper bound (at most)."""

    down: float  # bytes/s
    up: float  # bytes/s
    latency_s: float  # one way
    bounded: bool = False


async def _echo(bus: Bus, worker_id: str, probe: Probe, timeout_s: float) -> float | None:
    """Seconds for one echo, None when it timed out (probes go on the worker's own subject; the scheduler
    answers them on its own inbox only)."""
    start = time.perf_counter()
    try:
        await bus.request(SUBJECT_PROBE_FROM.format(worker_id=worker_id), probe, Probe, timeout_s,
                          MAX_PROBE_BYTES + PROBE_HEADROOM)
    except TimeoutError:
        return None
    return time.perf_counter() - start


async def _rate(bus: Bus, worker_id: str, make: Callable[[int], Probe], largest: int, rtt: float,
                timeout_s: float) -> tuple[float, bool]:
    """(bytes/s, bounded) for one direction: probes grow from FIRST_PROBE_BYTES by PROBE_GROWTH."""
    size = min(FIRST_PROBE_BYTES, largest)
    while True:
        took = await _echo(bus, worker_id, make(size), timeout_s)
        if took is None:
            return size / timeout_s, True  # it did not move `size` bytes in `timeout_s`
        if took >= PROBE_TARGET_S or size >= largest:
            return size / max(took - rtt, 1e-6), False
        size = min(largest, size * PROBE_GROWTH)


async def measure_links(bus: Bus, worker_id: str, timeout_s: float = DEFAULT_PROBE_TIMEOUT_S) -> Links:
    """The links to the hub: best-of-three 64 B echoes for latency, then up and down (see module doc)."""
    subject = SUBJECT_PROBE_FROM.format(worker_id=worker_id)
    try:
        rtts = [t for t in [await _echo(bus, worker_id, Probe(), timeout_s) for _ in range(3)] if t is not None]
    except Exception as e:  # e.g. no responders: no scheduler on the bus yet
        raise ProbeFailed(f"no echo on {subject}: {e!r}") from e
    if not rtts:
        raise ProbeFailed(f"no echo on {subject} within {timeout_s}s (is the scheduler up?)")
    rtt = min(rtts)
    largest = min(MAX_PROBE_BYTES, bus.max_payload - PROBE_HEADROOM)
    up, up_bounded = await _rate(bus, worker_id, lambda n: Probe(payload=bytes(n)), largest, rtt, timeout_s)
    down, down_bounded = await _rate(bus, worker_id, lambda n: Probe(reply_bytes=n), largest, rtt, timeout_s)
    return Links(down=down, up=up, latency_s=rtt / 2, bounded=up_bounded or down_bounded)
