"""The scheduler's probe echo under the shared worker credential (`cleave auth init` without --worker-ids: every
worker may claim any id), against a real nats-server running the generated permissions and the real scheduler
process with a small echo budget: probes from many fresh ids draw at most that budget of all workers together,
and workers joining at once past it are still measured, as their links are. What the scheduler sent is what
nats-server counted on its probe connection (`/connz`)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from cleave import auth, codec
from cleave import bus as busmod
from cleave.api.natsconf import free_port
from cleave.api.stack import Stack
from cleave.schemas import SUBJECT_PROBE_FROM, Probe
from cleave_cli import auth_cmd
from cleave_worker.probe import measure_links
from tests.integration.authserver import init_args, start_server

pytestmark = pytest.mark.timeout(120)
BURST, RATE = 4 << 20, 2 << 20  # the scheduler's echo budget here: 4 MiB at once, 2 MiB/s after
MAX_ECHO = 1 << 20  # at most max_payload (auth init's 1 MiB here)
PER_MESSAGE = 256  # what NATS adds to one answer: its subjects and sizes
WAIT_S = 30.0


@dataclass
class SharedHub:
    """The auth directory of `cleave auth init` (one shared worker credential), its nats-server and the
    scheduler."""

    out: Path
    url: str
    monitor: str
    stack: Stack

    def seed(self, name: str, var: str = "") -> str:
        line = next(x for x in (self.out / f"{name}.env").read_text().splitlines() if x.startswith(var or "CLEAVE_"))
        return line.split("=", 1)[1]

    async def worker(self, worker_id: str) -> busmod.Bus:
        """A connection with the shared worker credential, as the worker `worker_id` (its inbox, its probes)."""
        view = SimpleNamespace(nats_nkey_seed=self.seed("worker"), worker_id=worker_id)
        return await busmod.connect(self.url, f"cleave-worker-{worker_id}-probe", **auth.connect_options(view, "worker"))

    async def echoed(self) -> int:
        """Bytes the scheduler's probe connection has published so far, as nats-server counts them."""
        def read() -> dict:
            with urllib.request.urlopen(f"{self.monitor}/connz?limit=1024", timeout=5) as r:  # noqa: S310
                return json.loads(r.read())
        conns = (await asyncio.to_thread(read))["connections"]
        return next(c["in_bytes"] for c in conns if c.get("name") == "cleave-scheduler-probe")


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[SharedHub]:
    out, port, http = tmp_path / "auth", free_port(), free_port()
    auth_cmd.init(init_args(out, port, http=f"127.0.0.1:{http}"))
    server = start_server(out, tmp_path / "nats.log")
    stack = Stack(tmp_path / "run")
    stack.nats_url = f"nats://127.0.0.1:{port}"
    h = SharedHub(out, stack.nats_url, f"http://127.0.0.1:{http}", stack)
    try:
        stack.service("scheduler", "scheduler", env={
            "CLEAVE_SCHEDULER_NATS_NKEY_SEED": h.seed("scheduler"),
            "CLEAVE_SCHEDULER_PROBE_NKEY_SEED": h.seed("scheduler", "CLEAVE_SCHEDULER_PROBE_NKEY_SEED"),
            "CLEAVE_SCHEDULER_ECHO_BURST_BYTES": str(BURST), "CLEAVE_SCHEDULER_ECHO_BYTES_PER_S": str(RATE)})
        log, deadline = stack.run_dir / "logs" / "scheduler.log", time.monotonic() + WAIT_S
        while "scheduler_started" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline and stack.procs["scheduler"].popen.poll() is None, log.read_text()
            time.sleep(0.05)
        yield h
    finally:
        stack.stop_all()
        server.terminate()
        server.wait(timeout=10)


def bound(seconds: float, answers: int) -> float:
    """The most the scheduler may send over `seconds`: its burst, its rate, one echo of debt, and NATS's framing."""
    return BURST + RATE * seconds + MAX_ECHO + PER_MESSAGE * answers


async def test_probes_from_many_fresh_ids_draw_at_most_the_echo_budget(hub: SharedHub) -> None:
    """64 fresh ids ask two 1 MiB echoes each (128 MiB; each id's own budget would allow 32 MiB), from 32-byte
    probes answered on each id's own inbox: the scheduler sends at most its budget for all of them."""
    flooder = await hub.worker("flooder")
    try:
        before, started = await hub.echoed(), time.monotonic()
        big = codec.encode(Probe(reply_bytes=4 << 20), compress=False)  # as an older worker's probe: no refusals
        for i in range(128):
            worker = f"fresh{i % 64}"
            await flooder.nc.publish(SUBJECT_PROBE_FROM.format(worker_id=worker), big,
                                     reply=f"_INBOX.worker.{worker}.p.{i}")
        # answered after every probe of the flood (the scheduler takes one connection's probes in order)
        await flooder.request(SUBJECT_PROBE_FROM.format(worker_id="flooder"), Probe(), Probe, timeout_s=WAIT_S)
        sent, took = await hub.echoed() - before, time.monotonic() - started
    finally:
        await flooder.close()
    assert BURST - MAX_ECHO <= sent <= bound(took, 129), (sent, took)


async def test_workers_joining_at_once_past_the_budget_are_measured_as_their_links_are(hub: SharedHub) -> None:
    """Twelve workers measure their links at once (~1.3 MiB of echoes each, 16 MiB in all, four times the
    burst): refused echoes are asked again later, so every worker is measured, none reports the slow link an
    unanswered probe proves, and the scheduler stays within its budget meanwhile."""
    ids = [f"joiner{i}" for i in range(12)]
    buses = [await hub.worker(w) for w in ids]
    try:
        before, started = await hub.echoed(), time.monotonic()
        links = await asyncio.wait_for(asyncio.gather(*(measure_links(b, w) for b, w in zip(buses, ids, strict=True))),
                                       90)
        sent, took = await hub.echoed() - before, time.monotonic() - started
    finally:
        for b in buses:
            await b.close()
    assert all(not x.bounded and x.down > 1e6 and x.up > 1e6 for x in links), links  # (unanswered: 0.2 MB/s)
    # 9 answers a worker, and while it waits at most a refusal a second
    assert BURST < sent <= bound(took, len(ids) * (9 + int(took) + 1)), (sent, took)
