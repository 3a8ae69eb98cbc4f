"""Measure this worker's links to the hub over NATS: latency (64 B echo), then uplink and downlink with
probes that start small and grow until one transfer takes PROBE_TARGET_S (or reaches the largest size).

A probe that times out proves only that the link is no faster than its bytes over the time waited: that
bound is what it reports, never a default. When not even the small echo comes back (no scheduler yet, or
the link is down) `ProbeFailed` is raised and the worker stays out of the fleet until a probe succeeds.

The scheduler echoes within a budget of all workers together: past it, it refuses a probe and says when to ask
again. A refused probe is asked again then (jittered, so that a fleet joining at once spreads out) and timed
afresh: a busy hub makes a measurement slower, never a link slower. A measurement refused for
`DEFAULT_REFUSED_WAIT_S` fails (`ProbeFailed`): a first one is tried again, a re-measurement keeps the last
profile.
"""

from __future__ import annotations

import asyncio
import random
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
DEFAULT_REFUSED_WAIT_S = 300.0  # a measurement refused this long fails (1,000 fast workers at once: ~3 min)
MIN_RETRY_S = 1.0  # a refused probe is asked again after the scheduler's hint, at least this, times 1 to 1.5


@dataclass(frozen=True)
class Links:
    """What the probes proved. `bounded`: a probe timed out, so a rate is an upper bound (at most)."""

    down: float  # bytes/s
    up: float  # bytes/s
    latency_s: float  # one way
    bounded: bool = False


async def _echo(bus: Bus, worker_id: str, probe: Probe, timeout_s: float, refused_until: float) -> float | None:
    """Seconds for one echo, None when it timed out (probes go on the worker's own subject; the scheduler
    answers them on its own inbox only). A refused probe is asked again when the refusal says, until
    `refused_until` (monotonic), then ProbeFailed."""
    subject = SUBJECT_PROBE_FROM.format(worker_id=worker_id)
    while True:
        start = time.perf_counter()
        try:
            answer = await bus.request(subject, probe, Probe, timeout_s, MAX_PROBE_BYTES + PROBE_HEADROOM)
        except TimeoutError:
            return None
        if not answer.retry_after_s:
            return time.perf_counter() - start
        wait = max(answer.retry_after_s, MIN_RETRY_S) * random.uniform(1.0, 1.5)  # jittered: a fleet spreads out
        if time.monotonic() + wait > refused_until:
            raise ProbeFailed(f"the scheduler kept refusing to echo on {subject} (its echo budget is spent: a "
                              "fleet joining at once, or a flood)")
        await asyncio.sleep(wait)  # (a backoff: the refusal said when the budget has room again)


async def _rate(bus: Bus, worker_id: str, make: Callable[[int], Probe], largest: int, rtt: float,
                timeout_s: float, refused_until: float) -> tuple[float, bool]:
    """(bytes/s, bounded) for one direction: probes grow from FIRST_PROBE_BYTES by PROBE_GROWTH."""
    size = min(FIRST_PROBE_BYTES, largest)
    while True:
        took = await _echo(bus, worker_id, make(size), timeout_s, refused_until)
        if took is None:
            return size / timeout_s, True  # it did not move `size` bytes in `timeout_s`
        if took >= PROBE_TARGET_S or size >= largest:
            return size / max(took - rtt, 1e-6), False
        size = min(largest, size * PROBE_GROWTH)


async def measure_links(bus: Bus, worker_id: str, timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
                        refused_wait_s: float = DEFAULT_REFUSED_WAIT_S) -> Links:
    """The links to the hub: best-of-three 64 B echoes for latency, then up and down (see module doc)."""
    subject = SUBJECT_PROBE_FROM.format(worker_id=worker_id)
    until = time.monotonic() + refused_wait_s
    try:
        rtts = [t for t in [await _echo(bus, worker_id, Probe(refusable=True), timeout_s, until) for _ in range(3)]
                if t is not None]
    except Exception as e:  # e.g. no responders: no scheduler on the bus yet
        raise ProbeFailed(f"no echo on {subject}: {e!r}") from e
    if not rtts:
        raise ProbeFailed(f"no echo on {subject} within {timeout_s}s (is the scheduler up?)")
    rtt = min(rtts)
    largest = min(MAX_PROBE_BYTES, bus.max_payload - PROBE_HEADROOM)
    up, up_bounded = await _rate(bus, worker_id, lambda n: Probe(payload=bytes(n), refusable=True), largest, rtt,
                                 timeout_s, until)
    down, down_bounded = await _rate(bus, worker_id, lambda n: Probe(reply_bytes=n, refusable=True), largest, rtt,
                                     timeout_s, until)
    return Links(down=down, up=up, latency_s=rtt / 2, bounded=up_bounded or down_bounded)
