"""The monitor service: replays the event stream and watches the registry and plan, serves the dashboard.

The I/O shell around `cleave_monitor.core`: an ordered JetStream consumer reads CLEAVE_EVENTS from the
first message (so a restarted or late monitor shows the whole history), KV watchers follow the device
registry, the current plan and the hub runner's jobs, and every change goes to the state and, as a live update, to the pages
watching. The HTTP server is up before NATS is reached, and its URL is logged (`monitor_started`) and
written to `url_file` for supervisors.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import structlog

from cleave import auth, codec
from cleave import bus as busmod
from cleave.errors import ConfigError, WireError
from cleave.runtime.files import write_atomic
from cleave.runtime.lifecycle import run
from cleave.runtime.logs import configure
from cleave.schemas import (
    EVENTS_STREAM,
    JOBS_BUCKET,
    MAX_CONTROL_BYTES,
    MAX_PLAN_BYTES,
    PLAN_BUCKET,
    PLAN_KEY,
    REGISTRY_BUCKET,
    SUBJECT_EVENTS_ALL,
    DeviceRecord,
    JobRecord,
    Plan,
    StepMetrics,
    event_schema,
)
from cleave_monitor import guard, web
from cleave_monitor.core import MonitorState, Update
from cleave_monitor.hub import Hub
from cleave_monitor.settings import MonitorSettings

log = structlog.get_logger("monitor")
KV_DELETES = ("DEL", "PURGE")


class Feed:
    """Applies bus messages to the state and pushes the live updates to the hub."""

    def __init__(self, state: MonitorState, hub: Hub) -> None:
        self.state, self.hub = state, hub
        self.status_dirty = asyncio.Event()

    def apply(self, update: Update | None) -> None:
        if update is None:  # a copy of a message seen before: nothing changed
            return
        kind, data = update
        if kind in ("metrics", "event"):
            self.hub.publish(kind, data)
        elif kind == "forgotten":  # (a page draws itself again from a snapshot without the job)
            self.hub.publish("snapshot", self.state.snapshot(time.time()))
        self.status_dirty.set()  # fleet, plan and totals go out on the status timer

    def on_stream_message(self, subject: str, data: bytes) -> None:
        """One message of CLEAVE_EVENTS: step metrics on `cleave.events.metrics`, an Event otherwise."""
        schema = event_schema(subject)
        try:
            msg = codec.decode(data, schema, MAX_CONTROL_BYTES)
        except WireError as e:
            self.state.rejected += 1
            log.warning("message_rejected", reason=e.reason, subject=subject, detail=str(e)[:200])
            return
        self.apply(self.state.on_metrics(msg) if schema is StepMetrics else self.state.on_event(msg))

    def on_registry_entry(self, key: str, op: str | None, value: bytes | None) -> None:
        if op in KV_DELETES or not value:
            self.apply(self.state.on_device_gone(key, time.time()))
            return
        try:
            rec = codec.decode(value, DeviceRecord, MAX_CONTROL_BYTES)
        except WireError as e:
            self.state.rejected += 1
            log.warning("registry_entry_rejected", key=key, reason=e.reason)
            return
        self.apply(self.state.on_device(rec))

    def on_job_entry(self, key: str, op: str | None, value: bytes | None) -> None:
        """The hub runner's record of a submitted job (bucket cleave-jobs)."""
        if op in KV_DELETES or not value:
            self.apply(self.state.on_job_gone(key))
            return
        try:
            rec = codec.decode(value, JobRecord, MAX_CONTROL_BYTES)
        except WireError as e:
            self.state.rejected += 1
            log.warning("job_record_rejected", key=key, reason=e.reason)
            return
        self.apply(self.state.on_job_record(rec))

    def on_plan_entry(self, value: bytes | None) -> None:
        if not value:
            return
        try:
            plan = codec.decode(value, Plan, MAX_PLAN_BYTES)
        except WireError as e:
            self.state.rejected += 1
            log.warning("plan_rejected", reason=e.reason)
            return
        self.apply(self.state.on_plan(plan))

    async def push_status(self, stop: asyncio.Event, every_s: float) -> None:
        """Send fleet, plan and totals to the pages at most every `every_s` (and then on the clock, for liveness)."""
        while not stop.is_set():
            await wait_any(every_s * 5, self.status_dirty, stop)  # unchanged: send anyway, liveness ages
            self.status_dirty.clear()
            if self.hub.watchers:
                self.hub.publish("status", self.state.status(time.time()))
            await wait_any(every_s, stop)


async def wait_any(timeout_s: float, *events: asyncio.Event) -> None:
    """Return when one of `events` is set or after `timeout_s`, whichever comes first."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


async def follow_bus(s: MonitorSettings, ctx: web.Context, feed: Feed, stop: asyncio.Event, options: dict) -> None:
    bus = await busmod.connect(s.nats_url, "cleave-monitor", stop=stop, **options)
    if bus is None:  # stopped before NATS was ever reached
        return
    ctx.nats_connected = True
    try:
        await bus.setup()
        log.info("monitor_following", nats=s.nats_url)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(bus.follow(EVENTS_STREAM, SUBJECT_EVENTS_ALL, feed.on_stream_message, stop))
            tg.create_task(bus.watch(REGISTRY_BUCKET, ">", feed.on_registry_entry, stop))
            tg.create_task(bus.watch(PLAN_BUCKET, PLAN_KEY, lambda key, op, value: feed.on_plan_entry(value), stop))
            tg.create_task(bus.watch(JOBS_BUCKET, ">", feed.on_job_entry, stop))
    finally:
        ctx.nats_connected = False
        await bus.close()


def write_url(path: Path, url: str) -> None:
    """Write atomically: a reader sees the whole URL or no file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, url + "\n")


async def serve(s: MonitorSettings, stop: asyncio.Event, ready: asyncio.Future[str] | None = None) -> int:
    """Serve until `stop` is set; `ready`, if given, gets the URL once the port is bound."""
    state = MonitorState(s.max_points, s.max_events, s.stale_s, s.fleet_rows)
    hub = Hub()
    token = s.token.get_secret_value() or (guard.new_token() if guard.needs_token(s.host) else "")
    allowed = frozenset(h.strip().lower() for h in s.allowed_hosts.split(",") if h.strip())
    ctx = web.Context(state, hub, keepalive_s=s.keepalive_s, bind=s.host, token=token, allowed_hosts=allowed)
    feed = Feed(state, hub)
    options = auth.connect_options(s, "monitor")  # (a wrong credential or CA named before anything starts)
    try:
        runner, url = await web.start(web.build_app(ctx), s.host, s.port)
    except OSError as e:  # a host that is not this machine's, a port in use
        raise ConfigError(f"the monitor cannot listen on {s.host}:{s.port}: {e.strerror or e}") from None
    log.info("monitor_started", url=f"{url}/?token={token}" if token else url, nats=s.nats_url)
    if s.url_file:
        write_url(s.url_file, url)  # without the token: supervisors record it (the token is the operator's)
    if ready is not None:
        ready.set_result(url)
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow_bus(s, ctx, feed, stop, options))
            tg.create_task(feed.push_status(stop, s.status_every_s))
    finally:
        hub.close()  # ends the live streams, so the server can stop without waiting for them
        await runner.cleanup()
    log.info("monitor_stopped")
    return 0


def main(settings: MonitorSettings | None = None) -> int:
    settings = settings or MonitorSettings()
    configure("monitor")
    log.info("settings_resolved", **settings.model_dump(mode="json"))  # (SecretStr fields print as ****)
    return run(lambda stop: serve(settings, stop))
