"""The monitor's HTTP face (aiohttp): the dashboard page and its assets, the JSON API, the live stream, /metrics.

Routes:
  GET /                  the dashboard (HTML; its script and style under /static/, served from this package)
  GET /api/state         everything at once: series of a job (?job=), events, fleet, plan, totals
  GET /api/series?job=J  the steps of one job
  GET /api/events        the event timeline
  GET /api/fleet         devices with liveness, share of tiles, throughput
  GET /api/plan          the current plan, predicted against measured step time
  GET /api/stream        server-sent events: `snapshot` first, then `metrics`, `event`, `status`
  GET /metrics           Prometheus text format
  GET /api/jobs          the hub's submitted jobs (queued, running, done, failed, cancelled)
  GET /healthz           200 with {"nats": true|false}
Every request but /healthz passes `cleave_monitor.guard` first (the Host header; the token beyond localhost).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from aiohttp import web

from cleave_monitor import guard, prom
from cleave_monitor.core import MonitorState
from cleave_monitor.hub import Hub, frame

STATIC = Path(str(resources.files("cleave_monitor") / "static"))
DEFAULT_WRITE_TIMEOUT_S = 10.0  # a watcher that does not take a frame in this long is dropped


@dataclass
class Context:
    state: MonitorState
    hub: Hub
    keepalive_s: float = 15.0
    nats_connected: bool = False
    bind: str = "127.0.0.1"  # the address it listens on
    token: str = ""  # asked for on every request (cleave_monitor.guard); empty on localhost
    allowed_hosts: frozenset[str] = frozenset()  # Host names answered besides the loopback names


CONTEXT = web.AppKey("context", Context)


def _json(data: object) -> web.Response:
    return web.Response(
        text=json.dumps(data, separators=(",", ":")),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})


async def api_state(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    return _json(ctx.state.snapshot(time.time(), known_job(request)))


async def api_series(request: web.Request) -> web.Response:
    state = request.app[CONTEXT].state
    job = known_job(request) or state.current_job
    return _json({"job": job, "points": state.series(job)})


def known_job(request: web.Request) -> str | None:
    """The job `?job=` names (None: none named); one the monitor has not seen is a 404, not another job's steps
    (JSON, as every answer of the API: `{"error": ...}`)."""
    state, job = request.app[CONTEXT].state, request.query.get("job") or None
    if job is not None and job not in state.jobs:
        error = f"no job {job!r}; known: {', '.join(state.jobs) or 'none'}"
        raise web.HTTPNotFound(text=json.dumps({"error": error}), content_type="application/json",
                               headers={"Cache-Control": "no-store"})
    return job


async def api_events(request: web.Request) -> web.Response:
    return _json({"events": list(request.app[CONTEXT].state.events)})


async def api_fleet(request: web.Request) -> web.Response:
    return _json(request.app[CONTEXT].state.fleet(time.time()))


async def api_plan(request: web.Request) -> web.Response:
    return _json({"plan": request.app[CONTEXT].state.plan_view()})


async def api_jobs(request: web.Request) -> web.Response:
    return _json({"jobs": request.app[CONTEXT].state.queue_view(time.time())})


async def metrics(request: web.Request) -> web.Response:
    body = prom.render(request.app[CONTEXT].state)
    return web.Response(body=body, headers={"Content-Type": prom.CONTENT_TYPE})


async def healthz(request: web.Request) -> web.Response:
    return _json({"ok": True, "nats": request.app[CONTEXT].nats_connected})


async def stream(request: web.Request) -> web.StreamResponse:
    """Server-sent events: a snapshot, then every update, until the page goes away or falls behind."""
    ctx = request.app[CONTEXT]
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)
    watcher = ctx.hub.join()  # joined before the snapshot is taken, with no await between: nothing is missed
    first = frame("snapshot", ctx.state.snapshot(time.time()))
    try:
        async with asyncio.timeout(DEFAULT_WRITE_TIMEOUT_S):
            await resp.write(first)
        while True:
            try:
                async with asyncio.timeout(ctx.keepalive_s):
                    item = await watcher.next()
            except TimeoutError:
                item = b": keepalive\n\n"
            if item is None:
                break
            async with asyncio.timeout(DEFAULT_WRITE_TIMEOUT_S):
                await resp.write(item)
    except (ConnectionResetError, TimeoutError):
        pass  # the page went away or stopped reading
    finally:
        ctx.hub.leave(watcher)
    return resp


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:  # noqa: ANN001 - aiohttp's
    """An error of the JSON API (an unknown route or method, the guard's 401 and 403) answers JSON too:
    `{"error": <its text>}`; the page and its files keep aiohttp's plain text."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if not request.path.startswith("/api/") or e.status < 400 or e.content_type == "application/json":
            raise
        text = e.text if e.text is not None and e.text != f"{e.status}: {e.reason}" else e.reason
        kept = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "www-authenticate")}
        return web.Response(status=e.status, reason=e.reason, text=json.dumps({"error": text}),
                            content_type="application/json", headers={"Cache-Control": "no-store", **kept})


def build_app(ctx: Context) -> web.Application:
    app = web.Application(middlewares=[json_errors, guard.middleware(ctx.bind, ctx.token, ctx.allowed_hosts)])
    app[CONTEXT] = ctx
    app.router.add_get("/", index)
    app.router.add_get("/api/state", api_state)
    app.router.add_get("/api/series", api_series)
    app.router.add_get("/api/events", api_events)
    app.router.add_get("/api/fleet", api_fleet)
    app.router.add_get("/api/plan", api_plan)
    app.router.add_get("/api/jobs", api_jobs)
    app.router.add_get("/api/stream", stream)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_static("/static/", STATIC)
    return app


async def start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Bind and serve; returns the runner (for cleanup) and the URL with the port actually bound."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return runner, f"http://{shown}:{bound}"
