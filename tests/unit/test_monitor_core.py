"""The monitor's pure core, Prometheus exposition and live-update fan-out, without a network."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from cleave.schemas import DeviceProfile, DeviceRecord, Event, JobRecord, Plan, PlanWorker, StepMetrics
from cleave.schemas.jobs import RUNNER_SILENT_S
from cleave_monitor import guard, prom
from cleave_monitor.core import MonitorState
from cleave_monitor.hub import Hub
from cleave_monitor.main import Feed

PROFILE = DeviceProfile(
    flops=5e9, memory_bytes=1 << 29, downlink_bytes_per_s=5e7, uplink_bytes_per_s=1e7, latency_s=0.02
)


def metrics(step: int, job: str = "j", **kw) -> StepMetrics:
    fields = dict(
        job=job,
        step=step,
        loss=5.0 - step / 10,
        step_time_s=0.5,
        workers=2,
        tiles=10,
        bytes_down=1000,
        bytes_up=100,
        tokens=256,
        at=1000.0 + step,
    )
    return StepMetrics(**{**fields, **kw})


def record(worker: str, tiles: int, at: float) -> DeviceRecord:
    return DeviceRecord(worker_id=worker, profile=PROFILE, first_seen=900.0, last_seen=at, tiles_done=tiles)


def test_series_totals_and_jobs():
    s = MonitorState()
    for i in range(3):
        kind, data = s.on_metrics(metrics(i))
        assert kind == "metrics" and data["point"]["step"] == i
    s.on_metrics(metrics(0, job="k", loss=float("nan"), tiles_resent=4, recoveries=1))
    assert s.current_job == "k"
    assert [p["step"] for p in s.series("j")] == [0, 1, 2]
    assert s.series()[0]["loss"] is None  # NaN has no JSON spelling
    assert s.series("j")[0]["tokens_per_s"] == 512.0
    t = s.totals
    assert (t.steps, t.tiles, t.tiles_resent, t.recoveries) == (4, 40, 4, 1)
    assert (t.bytes_down, t.tokens) == (4000, 1024)
    assert {j["job"]: j["steps"] for j in s.job_list()} == {"j": 3, "k": 1}
    assert s.snapshot(0.0, job="j")["series"] == s.series("j")


def test_the_hubs_jobs_are_listed_oldest_first_and_leave_when_deleted():
    s = MonitorState()
    s.on_job_record(JobRecord(job_id="b", job="{}", state="running", submitted_at=2.0, runs=1))
    kind, view = s.on_job_record(JobRecord(job_id="a", job="{}", state="queued", submitted_at=1.0))
    assert kind == "queue" and view["state"] == "queued"
    assert [j["job_id"] for j in s.status(0.0)["queue"]] == ["a", "b"]
    s.on_job_gone("a")
    assert [j["job_id"] for j in s.snapshot(0.0)["queue"]] == ["b"]
    # a job whose runner stopped stamping its record: said once RUNNER_SILENT_S have passed, not for an ended one
    s.on_job_record(JobRecord(job_id="b", job="{}", state="running", submitted_at=2.0, runs=1, heard_at=100.0))
    s.on_job_record(JobRecord(job_id="c", job="{}", state="done", submitted_at=3.0, runs=1, heard_at=100.0))
    assert [j["runner_silent_s"] for j in s.status(100.0 + RUNNER_SILENT_S)["queue"]] == [None, None]
    assert [j["runner_silent_s"] for j in s.status(700.0)["queue"]] == [600, None]
    # a running job whose PS says it has no worker to deal to, until a step comes after that word
    s.on_event(Event(kind="waiting_for_workers", at=710.0, job="b", step=4, detail={"since": 650.0, "faulty": 1}))
    assert [j["waiting_for_workers"] for j in s.status(720.0)["queue"]] == [
        {"since": 650.0, "step": 4, "faulty": 1}, None]
    s.on_metrics(StepMetrics(job="b", step=4, loss=2.0, step_time_s=1.0, workers=1, at=715.0))
    assert s.status(720.0)["queue"][0]["waiting_for_workers"] is None


async def test_a_forgotten_job_leaves_the_dashboard_whole_and_pages_draw_again():
    """`cleave forget` deletes the job's record and every event naming it on the hub; a running monitor drops
    its curve, its events and its PS's words too (a restarted one would not see them), and sends every page a
    snapshot without it. A record deleted of a job that never ran only leaves the queue."""
    s = MonitorState()
    feed = Feed(s, Hub())
    page = feed.hub.join()
    for job, at in (("old", 1.0), ("new", 2.0)):
        s.on_job_record(JobRecord(job_id=job, job="{}", state="done", submitted_at=at, runs=1))
        s.on_metrics(StepMetrics(job=job, step=0, loss=2.0, step_time_s=1.0, workers=1, at=at))
        s.on_event(Event(kind="job_done", at=at, job=job, step=0))
    s.on_event(Event(kind="waiting_for_workers", at=3.0, job="old", step=0))
    s.on_event(Event(kind="worker_joined", at=3.0, worker_id="w1"))  # the fleet's
    s.on_metrics(StepMetrics(job="old", step=1, loss=1.5, step_time_s=1.0, workers=1, at=4.0))
    assert s.current_job == "old" and s.last.job == "old"
    feed.on_job_entry("old", "PURGE", None)
    snap = s.snapshot(5.0)
    assert [j["job"] for j in snap["jobs"]] == ["new"] and [q["job_id"] for q in snap["queue"]] == ["new"]
    assert [(e["kind"], e["job"]) for e in snap["events"]] == [("job_done", "new"), ("worker_joined", "")]
    assert snap["job"] == s.current_job == "new" and [p["step"] for p in snap["series"]] == [0]
    assert s.last is None and "old" not in s.waits and s.totals.steps == 3  # (the totals count what was seen)
    sent = await page.next()
    assert sent.startswith(b"event: snapshot\n") and b'"jobs":[{"job":"new"' in sent
    s.on_job_record(JobRecord(job_id="refused", job="{}", state="failed", submitted_at=6.0))
    assert s.on_job_gone("refused") == ("queue", {"job_id": "refused"})  # it never ran: nothing else to drop


def test_a_step_line_or_event_told_again_is_dropped_and_a_step_run_again_counts():
    """A resumed PS without a metrics file tells its last commit's lines (each with its recovery events) again:
    the copies are neither drawn nor counted. A step run again after a resume from an older checkpoint is a new
    line (a new `at`) and is."""
    s = MonitorState()
    lost = Event(kind="recovered", at=1001.5, step=1, worker_id="a", cause="heartbeat_timeout", detect_s=0.2)
    told = [metrics(0), lost, metrics(1, recoveries=1, recovery=(lost,)), metrics(2)]
    feed = lambda m: s.on_event(m) if isinstance(m, Event) else s.on_metrics(m)  # noqa: E731
    assert all(feed(m) is not None for m in told)
    assert [feed(m) for m in (lost, told[2], told[3])] == [None] * 3  # told again by the PS resumed after step 2
    s.on_metrics(metrics(2, at=2000.0, loss=9.0))  # step 2 run again, after a resume from step 1's checkpoint
    assert [(p["step"], p["at"]) for p in s.series()] == [(0, 1000.0), (1, 1001.0), (2, 1002.0), (2, 2000.0)]
    t = s.totals
    assert (t.steps, t.tiles, t.recoveries, t.tokens, t.events["recovered"]) == (4, 40, 1, 1024, 1)
    assert len(s.events) == 1 and s.job_list()[0]["steps"] == 4
    s.on_metrics(metrics(0, job="k"))  # another job's step 0 at the same moment is its own
    assert s.totals.steps == 5 and len(s.series("k")) == 1


def test_what_is_remembered_to_drop_a_copy_is_bounded_and_the_same_for_the_same_stream():
    a, b = MonitorState(max_points=10, max_events=10), MonitorState(max_points=10, max_events=10)
    for s in (a, b):
        for i in range(25):
            s.on_metrics(metrics(i))
            s.on_event(Event(kind="tile_resent", at=float(i)))
        assert len(s.seen_lines.keys) == 10 and len(s.seen_events.keys) == 10
        assert s.on_metrics(metrics(24)) is None and s.on_event(Event(kind="tile_resent", at=24.0)) is None
    assert a.seen_lines.keys == b.seen_lines.keys and a.totals == b.totals


def test_host_names_the_dashboard_answers():
    assert guard.host_name("[::1]:8787") == "::1" and guard.host_name("hub.example.org:8787") == "hub.example.org"
    none = frozenset()
    assert guard.host_allowed("localhost:8787", "127.0.0.1", "", none)
    assert not guard.host_allowed("rebound.example.org", "127.0.0.1", "", none)  # DNS rebinding
    assert guard.host_allowed("10.0.0.5:8787", "10.0.0.5", "t", none)  # the address it listens on
    assert guard.host_allowed("anything.example.org", "0.0.0.0", "t", none)  # the token guards it
    assert not guard.host_allowed("other.example.org", "0.0.0.0", "t", frozenset({"hub.example.org"}))
    assert guard.needs_token("0.0.0.0") and not guard.needs_token("127.0.0.1")


def test_history_is_bounded():
    s = MonitorState(max_points=10, max_events=10)
    for i in range(25):
        s.on_metrics(metrics(i))
        s.on_event(Event(kind="tile_resent", at=float(i)))
    assert [p["step"] for p in s.series()] == list(range(15, 25))
    assert len(s.events) == 10 and s.totals.steps == 25 and s.totals.events["tile_resent"] == 25


def test_fleet_liveness_share_and_throughput():
    s = MonitorState(stale_s=5.0)
    s.on_device(record("a", 10, 1000.0))
    s.on_device(record("a", 30, 1002.0))
    s.on_device(record("b", 10, 1002.0))
    s.on_event(Event(kind="worker_joined", at=1001.0, worker_id="c"))
    rows = {d["worker_id"]: d for d in s.fleet(1003.0)["devices"]}
    assert rows["a"]["tiles_per_s"] == 10.0 and rows["a"]["share"] == 0.75 and rows["a"]["state"] == "live"
    assert rows["c"]["state"] == "joining"
    assert s.fleet(1010.0)["counts"] == {"stale": 2, "joining": 1}
    s.on_event(Event(kind="worker_lost", at=1004.0, worker_id="b", cause="heartbeat_timeout"))
    s.on_device_gone("a", 1004.0)
    assert s.fleet(1004.5)["counts"] == {"lost": 2, "joining": 1}
    s.on_device(record("a", 31, 1005.0))  # re-registered: live again
    assert {d["worker_id"]: d["state"] for d in s.fleet(1005.5)["devices"]}["a"] == "live"


def test_plan_predicted_against_measured():
    s = MonitorState()
    assert s.plan_view() is None
    for i in range(5):
        s.on_metrics(metrics(i, step_time_s=1.0 if i < 2 else 0.4))
    plan = Plan(
        version=3,
        created_at=1001.5,
        workers=(PlanWorker(worker_id="a", profile=PROFILE),),
        tile_rows=64,
        tile_cols=32,
        predicted_step_s=0.3,
        reason="leave",
    )
    kind, view = s.on_plan(plan)
    assert kind == "plan" and view["devices"] == ["a"] and view["predicted_step_s"] == 0.3
    assert view["measured_step_s"] == 0.4  # only the steps since the plan was made
    s.on_device(record("a", 1, 1000.0))
    assert s.fleet(1000.0)["devices"][0]["in_plan"] is True


def test_event_placed_after_the_latest_step():
    s = MonitorState()
    _, early = s.on_event(Event(kind="worker_joined", at=1.0, worker_id="a"))
    s.on_metrics(metrics(0))
    s.on_metrics(metrics(1))
    _, late = s.on_event(
        Event(kind="recovered", at=2.0, worker_id="a", detect_s=math.inf, detail={"x": math.nan})
    )
    assert early["after_step"] is None and late["after_step"] == 1
    assert late["detect_s"] is None and late["detail"] == {"x": None}


def test_prometheus_names_units_and_no_worker_labels():
    s = MonitorState()
    s.on_metrics(metrics(0, step_time_s=0.2, val_loss=4.5))
    s.on_metrics(metrics(1, step_time_s=3.0))
    s.on_device(record("a", 5, 1000.0))
    s.on_event(Event(kind="worker_lost", at=1001.0, worker_id="a"))
    families = {f.name: f for f in text_string_to_metric_families(prom.render(s).decode())}
    for f in families.values():
        assert f.name.startswith("cleave_"), f.name
        for sample in f.samples:
            assert not {"worker", "worker_id", "device"} & set(sample.labels), sample
    assert families["cleave_steps"].type == "counter"
    samples = {
        (x.name, tuple(sorted(x.labels.items()))): x.value for f in families.values() for x in f.samples
    }
    assert samples[("cleave_steps_total", ())] == 2
    assert samples[("cleave_wire_bytes_total", (("direction", "down"),))] == 2000
    assert samples[("cleave_events_total", (("kind", "worker_lost"),))] == 1
    assert samples[("cleave_step_duration_seconds_bucket", (("le", "0.25"),))] == 1
    assert samples[("cleave_step_duration_seconds_count", ())] == 2
    assert samples[("cleave_val_loss", ())] == 4.5
    assert samples[("cleave_devices", (("state", "lost"),))] == 1
    assert "cleave_dp_epsilon" not in families  # (a job without DP)
    s.on_metrics(metrics(2, dp_epsilon=4.377))  # a DP job's epsilon was only in its metrics file
    assert s.series()[-1]["dp_epsilon"] == 4.377
    families = {f.name: f for f in text_string_to_metric_families(prom.render(s).decode())}
    assert families["cleave_dp_epsilon"].samples[0].value == 4.377


async def test_hub_fans_out_and_cuts_off_a_slow_watcher():
    hub = Hub(queue_size=4)
    fast, slow = hub.join(), hub.join()
    for i in range(3):
        hub.publish("metrics", {"i": i})
        assert (await fast.next()).startswith(b'event: metrics\ndata: {"i":%d}' % i)
    hub.publish("metrics", {"i": 3})  # slow has 3 queued: one slot left, kept for the end marker
    assert slow.cut_off and slow not in hub.watchers and hub.cut_offs == 1
    got = [await slow.next() for _ in range(4)]
    assert got[-1] is None
    hub.close()
    assert await fast.next() is not None and await fast.next() is None
    assert await hub.join().next() is None  # joining a closed hub ends at once
