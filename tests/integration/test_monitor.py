"""The monitor on a real nats-server and a real HTTP port: API, live stream, /metrics, restart, a browser.

The browser is Debian's chromium, headless, driven over the DevTools protocol (aiohttp's websocket
client), so the test waits on the page's own state instead of sleeping. `.ci/run` installs chromium.
The screenshot is kept as `dashboard.png` in the test's tmp dir; with CLEAVE_DOCS_SCREENSHOT=1 it also
replaces docs/img/dashboard.png.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cleave import bus as busmod
from cleave.api.natsconf import free_port
from cleave.schemas import (
    JOBS_BUCKET,
    PLAN_BUCKET,
    PLAN_KEY,
    REGISTRY_BUCKET,
    DeviceProfile,
    DeviceRecord,
    Event,
    JobRecord,
    Plan,
    PlanWorker,
    StepMetrics,
)
from cleave_cli.monitor_cmd import start_monitor
from cleave_monitor.main import serve
from cleave_monitor.settings import MonitorSettings
from tests.integration.fleet import start_fleet

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_CHROMIUM = "chromium is not installed (.ci/run installs Debian's: apt-get install -y chromium)"
TIMEOUT_S = 60.0
TOKEN = "s3cret-s3cret-s3cret"  # a monitor token given (16 characters at least)
JOB_STEPS = 96  # long enough that the job still runs while chromium starts and watches the curve grow: 48
# tiny steps (0.2-0.4 s each) once ended first on a loaded machine
PROFILE = DeviceProfile(
    flops=5e9, memory_bytes=1 << 29, downlink_bytes_per_s=5e7, uplink_bytes_per_s=1e7, latency_s=0.02
)


# ---- helpers ---------------------------------------------------------------------------------------------
async def sse(session: aiohttp.ClientSession, url: str) -> AsyncIterator[tuple[str, dict]]:
    """The (kind, data) events of a server-sent-event stream, parsed from raw chunks."""
    async with session.get(url + "/api/stream") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        buf = b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                block, buf = buf.split(b"\n\n", 1)
                fields = dict(
                    line.split(": ", 1) for line in block.decode().split("\n") if not line.startswith(":")
                )
                if "event" in fields:
                    yield fields["event"], json.loads(fields["data"])


async def wait_steps(session: aiohttp.ClientSession, url: str, n: int, job: str | None = None) -> list[dict]:
    """Follow the stream until the monitor holds `n` steps of the current job; returns them."""
    steps: list[dict] = []
    async with asyncio.timeout(TIMEOUT_S), contextlib.aclosing(sse(session, url)) as stream:
        async for kind, data in stream:
            if kind == "snapshot":
                steps = list(data["series"]) if job in (None, data["job"]) else []
            elif kind == "metrics" and job in (None, data["job"]):
                steps.append(data["point"])
            if len(steps) >= n:
                return steps
    raise AssertionError("unreachable")


async def wait_event(session: aiohttp.ClientSession, url: str, kind: str) -> dict:
    """Follow the stream until the monitor holds an event of `kind`; returns it."""
    async with asyncio.timeout(TIMEOUT_S), contextlib.aclosing(sse(session, url)) as stream:
        async for got, data in stream:
            found = [e for e in data["events"] if e["kind"] == kind] if got == "snapshot" else [data]
            if found and found[0].get("kind") == kind:
                return found[0]
    raise AssertionError("unreachable")


async def get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def prom_samples(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    families = list(text_string_to_metric_families(text))
    assert all(f.name.startswith("cleave_") for f in families)
    assert all("worker_id" not in s.labels and "worker" not in s.labels for f in families for s in f.samples)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


class InProcessMonitor:
    """`cleave_monitor.main.serve` in this event loop on a free port."""

    def __init__(self, nats_url: str, tmp: Path, **over: object) -> None:
        self.settings = MonitorSettings(
            nats_url=nats_url, port=0, url_file=tmp / "url", status_every_s=0.1, stale_s=3600.0, **over
        )
        self.stop = asyncio.Event()

    async def __aenter__(self) -> str:
        self.settings.url_file.unlink(missing_ok=True)
        ready = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(serve(self.settings, self.stop, ready))
        url = await asyncio.wait_for(ready, TIMEOUT_S)
        assert self.settings.url_file.read_text().strip() == url
        return url

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        assert await asyncio.wait_for(self.task, TIMEOUT_S) == 0


# ---- published messages ------------------------------------------------------------------------------------
async def publish_history(bus: busmod.Bus, steps: range) -> None:
    reg, plans = await bus.kv(REGISTRY_BUCKET), await bus.kv(PLAN_BUCKET)
    for i, w in enumerate(("dev-a", "dev-b")):
        await bus.kv_put(
            reg,
            w,
            DeviceRecord(
                worker_id=w, profile=PROFILE, first_seen=1.0, last_seen=time.time(), tiles_done=10 * (i + 1)
            ),
        )
        await bus.emit(Event(kind="worker_joined", at=1.0, job="j", worker_id=w))
    plan = Plan(
        version=1,
        created_at=1.0,
        workers=(PlanWorker(worker_id="dev-a", profile=PROFILE),),
        tile_rows=64,
        tile_cols=64,
        predicted_step_s=0.2,
        reason="join",
    )
    await bus.kv_put(plans, PLAN_KEY, plan)
    for s in steps:
        await bus.emit(
            StepMetrics(
                job="j",
                step=s,
                loss=5.0 - s / 10,
                step_time_s=0.25,
                workers=2,
                tiles=8,
                bytes_down=1000,
                bytes_up=100,
                tokens=512,
                at=2.0 + s,
            )
        )


async def check_stream(bus: busmod.Bus, http: aiohttp.ClientSession, url: str) -> None:
    """A new watcher gets a snapshot, then each step and event as it is published, and status updates."""
    async with contextlib.aclosing(sse(http, url)) as stream:
        kind, snap = await anext(stream)
        assert kind == "snapshot" and len(snap["series"]) == 5
        await bus.emit(StepMetrics(job="j", step=5, loss=4.4, step_time_s=0.3, workers=2, at=7.0))
        await bus.emit(
            Event(
                kind="worker_lost", at=time.time() + 1, job="j", worker_id="dev-b", cause="heartbeat_timeout"
            )
        )
        seen: dict[str, dict] = {}
        async with asyncio.timeout(TIMEOUT_S):
            while not {"metrics", "event", "status"} <= seen.keys():
                kind, data = await anext(stream)
                if kind != "status" or (data["plan"] and data["fleet"]["counts"] == {"live": 1, "lost": 1}):
                    seen.setdefault(kind, data)
    assert seen["metrics"]["job"] == "j" and seen["metrics"]["point"]["loss"] == 4.4
    assert seen["event"]["kind"] == "worker_lost" and seen["event"]["after_step"] == 5


async def check_api(http: aiohttp.ClientSession, url: str) -> None:
    state = await get_json(http, url + "/api/state")
    assert [p["step"] for p in state["series"]] == list(range(6)) and state["rejected"] == 1
    fleet = {d["worker_id"]: d for d in (await get_json(http, url + "/api/fleet"))["devices"]}
    assert fleet["dev-a"]["state"] == "live" and fleet["dev-b"]["state"] == "lost"
    assert fleet["dev-b"]["share"] == pytest.approx(2 / 3) and fleet["dev-a"]["in_plan"]
    assert (await get_json(http, url + "/api/plan"))["plan"]["predicted_step_s"] == 0.2
    assert len((await get_json(http, url + "/api/events"))["events"]) == 3
    assert len((await get_json(http, url + "/api/series?job=j"))["points"]) == 6
    for path in ("/api/series?job=nope", "/api/state?job=nope"):  # (state gave another job's steps)
        async with http.get(url + path) as resp:  # JSON, as every answer of the API (it was text/plain)
            assert resp.status == 404 and resp.content_type == "application/json", (path, resp.content_type)
            assert await resp.json() == {"error": "no job 'nope'; known: j"}, path
    for path, status in (("/api/nope", 404), ("/api/state/x", 404)):  # (an unknown route answered text/plain)
        async with http.get(url + path) as resp:
            assert (resp.status, resp.content_type) == (status, "application/json"), path
            assert await resp.json() == {"error": "Not Found"}, path
    async with http.post(url + "/api/state") as resp:
        assert (resp.status, resp.content_type, resp.headers["Allow"]) == (405, "application/json", "GET,HEAD")
    async with http.get(url + "/nope") as resp:  # (the page's own routes keep plain text)
        assert (resp.status, resp.content_type) == (404, "text/plain")
    assert (await get_json(http, url + "/healthz"))["nats"] is True
    samples = await prom_samples(http, url)
    assert samples[("cleave_steps_total", ())] == 6 and samples[("cleave_tiles_total", ())] == 40
    assert samples[("cleave_monitor_messages_rejected_total", ())] == 1
    for path, ctype in (
        ("/", "text/html"),
        ("/static/dashboard.js", "javascript"),
        ("/static/dashboard.css", "css"),
    ):
        async with http.get(url + path) as resp:
            assert resp.status == 200 and ctype in resp.content_type, (path, resp.content_type)


async def test_api_stream_metrics_and_restart(nats_url, tmp_path):
    bus = await busmod.connect(nats_url, "test")
    await bus.setup()
    await publish_history(bus, range(5))
    await bus.js.publish("cleave.events.metrics", b"not a frame")  # rejected and counted, never a crash
    try:
        async with aiohttp.ClientSession() as http:
            async with InProcessMonitor(nats_url, tmp_path) as url:
                assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
                before = await wait_steps(http, url, 5)
                await check_stream(bus, http, url)
                await check_api(http, url)
            async with InProcessMonitor(nats_url, tmp_path) as url:  # a new monitor replays the whole stream
                after = await wait_steps(http, url, 6)
                assert after[:5] == before and after[5]["loss"] == 4.4
                assert len((await get_json(http, url + "/api/events"))["events"]) == 3
    finally:
        await bus.close()


async def test_the_host_header_and_the_token_guard_it_and_it_lists_the_hubs_jobs(nats_url, tmp_path):
    """On localhost only the loopback names are answered (a rebinding page's own name is refused); beyond it
    every request needs the token (query once, then the cookie it sets; or a bearer header), /healthz excepted.
    The hub runner's job records (bucket cleave-jobs) are listed."""
    bus = await busmod.connect(nats_url, "test")
    await bus.setup()
    try:
        async with aiohttp.ClientSession() as http, InProcessMonitor(nats_url, tmp_path) as url:
            async with http.get(url + "/api/state", headers={"Host": "rebound.example.org"}) as resp:
                assert resp.status == 403
            async with http.get(url + "/api/state", headers={"Host": "localhost"}) as resp:
                assert resp.status == 200
            rec = JobRecord(job_id="hub-job", job="{}", state="failed", submitted_at=1.0, runs=2, exit_code=4,
                            reason="changed seed")
            await bus.kv_put(await bus.kv(JOBS_BUCKET), "hub-job", rec)
            async with asyncio.timeout(TIMEOUT_S), contextlib.aclosing(sse(http, url)) as stream:
                async for kind, data in stream:  # the live status carries the queue once the watch has it
                    if kind in ("snapshot", "status") and data["queue"]:
                        break
            (job,) = (await get_json(http, url + "/api/jobs"))["jobs"]
            assert (job["job_id"], job["state"], job["runs"], job["reason"]) == ("hub-job", "failed", 2, "changed seed")
        guarded = InProcessMonitor(nats_url, tmp_path, host="0.0.0.0", token=TOKEN, allowed_hosts="hub.example.org")
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http, guarded as url:
            for path in ("/", "/api/state", "/metrics", "/api/stream"):
                async with http.get(url + path) as resp:
                    assert resp.status == 401, path
                    if path.startswith("/api/"):  # (the API's refusals were plain text)
                        assert "asks for its token" in (await resp.json())["error"], path
            async with http.get(url + "/healthz") as resp:
                assert resp.status == 200
            async with http.get(url + "/api/state?token=wrong") as resp:
                assert resp.status == 401
            for scheme in ("Bearer", "bearer"):  # (an auth scheme is case-insensitive: lowercase got 401)
                async with http.get(url + "/api/state", headers={"Authorization": f"{scheme} {TOKEN}"}) as resp:
                    assert resp.status == 200, scheme
            async with http.get(f"{url}/api/jobs?token={TOKEN}", headers={"Host": "evil.example.org"}) as resp:
                assert resp.status == 403  # the names it serves are listed: another one is refused
                assert "is not this dashboard's name" in (await resp.json())["error"]
            async with http.get(f"{url}/?token={TOKEN}", headers={"Host": "hub.example.org:8787"}) as resp:
                assert resp.status == 200 and "cleave_token" in resp.cookies
            async with http.get(url + "/api/jobs") as resp:  # the page's own requests: the cookie
                assert resp.status == 200
    finally:
        await bus.close()


# ---- a real job, a browser, a restart ------------------------------------------------------------------------
class Browser:
    """Headless chromium on one page, driven over the DevTools protocol."""

    def __init__(self, profile_dir: Path) -> None:
        self.profile_dir, self.seq = profile_dir, 0

    async def __aenter__(self) -> Browser:
        self.proc = await asyncio.create_subprocess_exec(
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--window-size=1400,1500",
            f"--user-data-dir={self.profile_dir}",
            "--remote-debugging-port=0",
            "about:blank",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(TIMEOUT_S):
            while not (
                m := re.search(rb"DevTools listening on ws://([\d.:]+)/", await self.proc.stderr.readline())
            ):
                pass
        self.http = aiohttp.ClientSession()
        targets = await get_json(self.http, f"http://{m.group(1).decode()}/json/list")
        page = next(t for t in targets if t["type"] == "page")
        self.ws = await self.http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self.drain = asyncio.create_task(self._drain_stderr())
        return self

    async def _drain_stderr(self) -> None:
        while await self.proc.stderr.read(65536):
            pass

    async def __aexit__(self, *exc: object) -> None:
        await self.ws.close()
        await self.http.close()
        self.proc.terminate()
        await asyncio.wait_for(self.proc.wait(), TIMEOUT_S)
        await self.drain

    async def call(self, method: str, until_event: str | None = None, **params: object) -> dict:
        self.seq += 1
        await self.ws.send_json({"id": self.seq, "method": method, "params": params})
        result = None
        async with asyncio.timeout(TIMEOUT_S):
            async for msg in self.ws:
                data = json.loads(msg.data)
                if data.get("id") == self.seq:
                    assert "error" not in data, data
                    result = data["result"]
                if result is not None and (until_event is None or data.get("method") == until_event):
                    return result
        raise AssertionError(f"no answer to {method}")

    async def wait_for(self, js_condition: str) -> object:
        """Evaluate `js_condition` in the page until it is truthy; returns its value."""
        expr = f"new Promise(r => {{ const f = () => {{ const v = ({js_condition}); v ? r(v) : setTimeout(f, 50); }}; f(); }})"
        res = await self.call("Runtime.evaluate", expression=expr, awaitPromise=True, returnByValue=True)
        assert "exceptionDetails" not in res, res
        return res["result"]["value"]


POINTS = "+document.getElementById('chart-loss').dataset.points"
DEVICES = "document.querySelectorAll('#fleet tbody tr.device').length"
LOST_MARKERS = "document.querySelectorAll('#chart-loss line.marker.worker_lost').length"


async def look_at_dashboard(url: str, tmp_path: Path) -> None:
    async with Browser(tmp_path / "chromium") as b:
        await b.call("Page.enable")
        await b.call("Page.navigate", until_event="Page.loadEventFired", url=url + "/")
        first = await b.wait_for(f"{POINTS} >= 1 && {DEVICES} >= 3 && {LOST_MARKERS} >= 1 && {POINTS}")
        assert await b.wait_for(f"{POINTS} > {first} && {POINTS}")  # the curve grows live, over the stream
        assert await b.wait_for("document.querySelectorAll('#chart-loss path.loss').length === 1")
        shot = await b.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
    png = base64.b64decode(shot["data"])
    (tmp_path / "dashboard.png").write_bytes(png)  # the test artifact
    if os.environ.get("CLEAVE_DOCS_SCREENSHOT") == "1":  # refresh the picture in the docs on request only
        (REPO / "docs" / "img").mkdir(parents=True, exist_ok=True)
        (REPO / "docs" / "img" / "dashboard.png").write_bytes(png)


async def start_job(nats_url: str, tmp_path: Path, metrics_out: Path) -> asyncio.subprocess.Process:
    argv = ["train", "--preset", "tiny", "--steps", str(JOB_STEPS), "--workers", "2", "--nats", nats_url]
    argv += ["--run-dir", str(tmp_path / "train"), "--metrics-out", str(metrics_out)]
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "cleave_cli",
        *argv,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )


async def check_history(http: aiohttp.ClientSession, url: str, metrics_out: Path) -> None:
    """The restarted monitor holds every step the PS wrote, the fleet with its churn, and the counters."""
    want = [json.loads(line) for line in (await asyncio.to_thread(metrics_out.read_text)).splitlines()]
    got = await wait_steps(http, url, JOB_STEPS)
    assert [(p["step"], p["loss"]) for p in got] == [(m["step"], m["loss"]) for m in want]
    samples = await prom_samples(http, url)
    assert samples[("cleave_steps_total", ())] == JOB_STEPS
    assert samples[("cleave_tiles_total", ())] == sum(m["tiles"] for m in want) > 0
    fleet_view = await get_json(http, url + "/api/fleet")
    assert fleet_view["counts"] == {"live": 2, "lost": 1}, fleet_view
    assert sum(d["share"] for d in fleet_view["devices"]) == pytest.approx(1.0)
    kinds = [e["kind"] for e in (await get_json(http, url + "/api/events"))["events"]]
    assert kinds.count("worker_joined") == 3 and kinds.count("worker_lost") == 1 and "plan_changed" in kinds


async def test_dashboard_during_a_real_job_and_restart(nats_url, tmp_path):
    fleet = await asyncio.to_thread(start_fleet, tmp_path / "stack", nats_url, 2)
    try:
        port = free_port()
        url = await asyncio.to_thread(start_monitor, fleet.stack, port)
        assert json.loads((tmp_path / "stack" / "stack.json").read_text())["dashboard_url"] == url
        metrics_out = tmp_path / "metrics.jsonl"
        job = await start_job(nats_url, tmp_path, metrics_out)
        async with aiohttp.ClientSession() as http:
            await wait_steps(http, url, 1)
            fleet.stack.kill("worker-1", restart=False)  # churn: lost, re-planned, replaced
            fleet.add_worker()
            await wait_event(http, url, "worker_lost")
            if CHROMIUM:
                await look_at_dashboard(url, tmp_path)
            fleet.stack.kill("monitor", signal.SIGKILL, restart=False)
            assert await asyncio.to_thread(start_monitor, fleet.stack, port) == url
            assert job.returncode is None, "the job ended before the monitor was restarted"
            assert await asyncio.wait_for(job.wait(), 240) == 0
            await check_history(http, url, metrics_out)
    finally:
        await asyncio.to_thread(fleet.stop)
    if not CHROMIUM:
        pytest.skip(f"the browser part did not run: {NO_CHROMIUM}")


def test_a_dashboard_port_in_use_is_told_in_the_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`cleave up --dashboard-listen` on a busy port said only 'the monitor exited with 2; see its log'."""
    import socket  # noqa: PLC0415

    from cleave_cli.main import main  # noqa: PLC0415

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["up", "--workers", "0", "--run-dir", str(tmp_path / "up"),
                     "--dashboard-listen", f"127.0.0.1:{port}"]) == 2
    said = capsys.readouterr().err
    assert f"the monitor exited with 2: the monitor cannot listen on 127.0.0.1:{port}" in said, said
    assert "address already in use" in said
