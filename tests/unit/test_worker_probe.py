"""The worker's link probes against a scheduler whose echo budget is spent, without a bus: a refused probe is
asked again when the refusal says and timed afresh, so a busy hub makes a measurement slower, never the link
it measures; one refused for too long fails. A virtual clock stands in for time: the fake bus advances it by
each transfer, the worker's backoff by each wait."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cleave.errors import ProbeFailed
from cleave.schemas import Probe
from cleave_worker import probe as probemod

RATE = 10e6  # bytes/s each way
RTT = 0.01


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    monotonic = perf_counter

    async def sleep(self, s: float) -> None:
        self.now += s


class BusyHub:
    """The scheduler's probe echo: refuses each echo of bytes `refusals` times (saying 'ask again in 2 s')."""

    max_payload = 8 << 20

    def __init__(self, clock: Clock, refusals: int) -> None:
        self.clock, self.refusals, self.asked, self.refused = clock, refusals, [], 0

    async def request(self, subject: str, probe: Probe, schema: type, timeout_s: float, max_bytes: int) -> Probe:
        assert probe.refusable and subject == "cleave.probe.w1"
        self.asked.append(probe.reply_bytes)
        if probe.reply_bytes and self.asked.count(probe.reply_bytes) <= self.refusals:
            self.refused += 1
            self.clock.now += RTT
            return Probe(retry_after_s=2.0)
        self.clock.now += RTT + (len(probe.payload) + probe.reply_bytes) / RATE
        return Probe(payload=bytes(probe.reply_bytes))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(probemod, "time", c)
    monkeypatch.setattr(probemod, "asyncio", SimpleNamespace(sleep=c.sleep), raising=False)  # its backoff only
    return c


async def test_a_refused_probe_is_asked_again_and_the_link_measured_as_it_is(clock: Clock) -> None:
    hub = BusyHub(clock, refusals=2)
    links = await probemod.measure_links(hub, "w1")
    assert not links.bounded and links.down == pytest.approx(RATE) and links.up == pytest.approx(RATE)
    assert hub.refused == 2 * 4  # each downlink size (64 KiB .. 4 MiB) twice
    assert clock.now > 8 * 2.0  # it waited at least what each refusal said


async def test_a_measurement_refused_for_too_long_fails(clock: Clock) -> None:
    with pytest.raises(ProbeFailed, match="kept refusing"):
        await probemod.measure_links(BusyHub(clock, refusals=10**9), "w1", refused_wait_s=30.0)
    assert clock.now <= 30.0 + 1.0
