"""A measuring worker keeps three NATS connections: tiles and results on `cleave-worker-<id>`, heartbeats on
`...-hb`, link probes on `...-probe`, so that neither a heartbeat nor a result ever queues behind a probe's
upload. Checked on a real nats-server by who made each probe request (/connz), first probe and re-probes."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from cleave import bus as busmod
from cleave import codec
from cleave.schemas import MAX_PROBE_BYTES, SUBJECT_PROBE_ALL, Probe
from cleave_worker.main import run_worker
from cleave_worker.settings import WorkerSettings
from tests.integration.test_swarm import nats_with_monitor  # noqa: F401  (a fixture)

WAIT_S = 60.0
MEASUREMENTS = 3  # the first and two re-probes


def subscriptions(monitor: str) -> dict[str, list[str]]:
    """Connection name -> its subscriptions, from nats-server's /connz."""
    with urllib.request.urlopen(f"{monitor}/connz?subs=1&limit=1000", timeout=5) as r:
        return {c.get("name", ""): c.get("subscriptions_list") or [] for c in json.load(r)["connections"]}


async def test_probes_and_re_probes_travel_on_their_own_connection(nats_with_monitor):  # noqa: F811
    nats_url, monitor = nats_with_monitor
    replies: list[str] = []  # the reply subject of every probe request
    opened = 0  # measurements begun: three 64 B echoes open each
    measured = asyncio.Event()
    bus = await busmod.connect(nats_url, "test-scheduler")

    async def echo(msg) -> None:  # the scheduler's answer (`Scheduler.on_probe`), noting who asked
        nonlocal opened
        probe = codec.decode(msg.data, Probe, MAX_PROBE_BYTES + 1024)
        replies.append(msg.reply)
        opened += not probe.payload and not probe.reply_bytes
        if opened >= 3 * MEASUREMENTS:
            measured.set()
        await msg.respond(codec.encode(Probe(payload=bytes(probe.reply_bytes)), compress=False))

    await bus.nc.subscribe(SUBJECT_PROBE_ALL, cb=echo)
    settings = WorkerSettings(nats_url=nats_url, worker_id="w1", probe_every_s=0.3, heartbeat_s=0.25)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop, flops=1e9))
    try:
        await asyncio.wait_for(measured.wait(), WAIT_S)
        subs = await asyncio.to_thread(subscriptions, monitor)
    finally:
        stop.set()
        assert await asyncio.wait_for(worker, WAIT_S) == 0
        await bus.close()
    assert {"cleave-worker-w1", "cleave-worker-w1-hb", "cleave-worker-w1-probe"} <= set(subs)
    askers = {name for name, mine in subs.items() for r in replies
              if any(s.endswith(".*") and r.startswith(s[:-1]) for s in mine)}
    assert askers == {"cleave-worker-w1-probe"}, askers
    assert not any(s.startswith("_INBOX") for s in subs["cleave-worker-w1"])  # the tiles' connection asks nothing
