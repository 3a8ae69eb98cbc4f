"""The monitor's pure core: step and event history, running totals, the fleet view and the plan. No I/O.

Everything it knows comes in through `on_metrics`, `on_event`, `on_device`, `on_device_gone`, `on_plan` and
`on_job_record` (the hub runner's record of a submitted job), in the order the bus delivers it; replaying the same stream rebuilds the same state, which
is how the monitor's history survives its own restart. Each `on_*` returns the live update (`kind`,
JSON-ready data) for pages that are watching, or None for a message it drops.

A step line or event seen before (a PS without a metrics file tells its last commit's lines, and their
recovery events, again when it resumes) is dropped, neither shown nor counted: a line is known by its job, step
and `at` (its own timestamp, the same in a copy), an event by its kind, job, step, device, cause and `at`. A job
that runs steps again (resumed from an older checkpoint) reports new lines, with a new `at`, and they count.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

from cleave.schemas import DeviceProfile, DeviceRecord, Event, JobRecord, Plan, StepMetrics
from cleave.schemas.jobs import runner_silent_s, waiting_for_workers

STEP_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf)  # seconds
MEASURED_WINDOW = 10  # steps whose median is "measured step time" against the plan's prediction

Update = tuple[str, dict]


def finite(x: float | None) -> float | None:
    """NaN and infinities as None: JSON has no spelling for them."""
    return x if x is None or math.isfinite(x) else None


def point(m: StepMetrics) -> dict:
    """One step as the dashboard draws it."""
    return {
        "step": m.step,
        "method": m.method,  # a round method's steps are rounds
        "loss": finite(m.loss),
        "val_loss": finite(m.val_loss),
        "step_time_s": finite(m.step_time_s),
        "predicted_step_s": finite(m.predicted_step_s),
        "tokens_per_s": finite(m.tokens / m.step_time_s) if m.step_time_s > 0 else None,
        "workers": m.workers,
        "tiles": m.tiles,
        "tiles_resent": m.tiles_resent,
        "tiles_dropped": m.tiles_dropped,
        "bytes_down": m.bytes_down,
        "bytes_up": m.bytes_up,
        "recoveries": m.recoveries,
        "lr": m.lr,
        "dp_epsilon": finite(m.dp_epsilon),  # a DP job's epsilon spent up to this round
        "at": m.at,
    }


class Seen:
    """The last `size` keys seen, oldest forgotten first: a bounded set that the same stream fills the same way."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.keys: dict[tuple, None] = {}  # (insertion-ordered: the oldest first)

    def first(self, key: tuple) -> bool:
        """Whether `key` is new (and now remembered)."""
        if key in self.keys:
            return False
        self.keys[key] = None
        if len(self.keys) > self.size:
            del self.keys[next(iter(self.keys))]
        return True


@dataclass
class Totals:
    """Counters over every step and event seen (all jobs): what /metrics exports as `_total`."""

    steps: int = 0
    tiles: int = 0
    tiles_resent: int = 0
    tiles_dropped: int = 0
    results_rejected: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    tokens: int = 0
    recoveries: int = 0
    step_time_sum_s: float = 0.0
    step_time_buckets: list[int] = field(default_factory=lambda: [0] * len(STEP_TIME_BUCKETS))
    events: Counter[str] = field(default_factory=Counter)

    def add(self, m: StepMetrics) -> None:
        self.steps += 1
        self.tiles += m.tiles
        self.tiles_resent += m.tiles_resent
        self.tiles_dropped += m.tiles_dropped
        self.results_rejected += m.rejected
        self.bytes_down += m.bytes_down
        self.bytes_up += m.bytes_up
        self.tokens += m.tokens
        self.recoveries += m.recoveries
        self.step_time_sum_s += m.step_time_s
        for i, le in enumerate(STEP_TIME_BUCKETS):  # cumulative, as Prometheus histograms are
            if m.step_time_s <= le:
                self.step_time_buckets[i] += 1

    def view(self) -> dict:
        return {
            "steps": self.steps,
            "tiles": self.tiles,
            "tiles_resent": self.tiles_resent,
            "tiles_dropped": self.tiles_dropped,
            "results_rejected": self.results_rejected,
            "bytes_down": self.bytes_down,
            "bytes_up": self.bytes_up,
            "tokens": self.tokens,
            "recoveries": self.recoveries,
            "events": dict(self.events),
        }


@dataclass
class DeviceRow:
    """What the monitor knows of one device: its registry entry, its throughput, whether it is gone."""

    worker_id: str
    profile: DeviceProfile | None = None
    first_seen: float = 0.0
    last_seen: float = 0.0
    tiles_done: int = 0
    tiles_per_s: float | None = None  # from the last two registry entries that differ in tiles_done
    lost_at: float | None = None

    def update(self, rec: DeviceRecord) -> None:
        dt = rec.last_seen - self.last_seen
        if self.last_seen and dt > 0 and rec.tiles_done >= self.tiles_done:
            self.tiles_per_s = (rec.tiles_done - self.tiles_done) / dt
        self.profile, self.first_seen, self.last_seen = rec.profile, rec.first_seen, rec.last_seen
        self.tiles_done = rec.tiles_done
        if self.lost_at is not None and rec.last_seen > self.lost_at:
            self.lost_at = None  # back (or re-registered under the same id)

    def state(self, now: float, stale_s: float) -> str:
        if self.lost_at is not None:
            return "lost"
        if self.profile is None:
            return "joining"  # seen in an event, not yet in the registry
        return "live" if now - self.last_seen <= stale_s else "stale"


class MonitorState:
    """All the monitor shows, built from the bus's messages in order."""

    def __init__(
        self, max_points: int = 20_000, max_events: int = 10_000, stale_s: float = 6.0, fleet_rows: int = 500
    ) -> None:
        self.max_points, self.stale_s, self.fleet_rows = max_points, stale_s, fleet_rows
        self.jobs: dict[str, deque[dict]] = {}
        self.current_job: str | None = None
        self.events: deque[dict] = deque(maxlen=max_events)
        self.devices: dict[str, DeviceRow] = {}
        self.plan: Plan | None = None
        self.totals = Totals()
        self.last: StepMetrics | None = None
        self.rejected = 0  # malformed messages the shell could not decode
        self.queue: dict[str, dict] = {}  # job id -> the hub runner's record of it (`cleave submit`'s jobs)
        self.waits: dict[str, Event] = {}  # job id -> its PS's latest word that it has no worker to deal to
        # the latest lines and events, to drop a copy: one comes soon after its first (a resume re-tells the
        # last commit's lines), so as many as the history keeps are remembered
        self.seen_lines, self.seen_events = Seen(max_points), Seen(max_events)

    # ---- inputs ---------------------------------------------------------------------------------------
    def on_metrics(self, m: StepMetrics) -> Update | None:
        if not self.seen_lines.first((m.job, m.step, m.at)):
            return None
        series = self.jobs.get(m.job)
        if series is None:
            series = self.jobs[m.job] = deque(maxlen=self.max_points)
        p = point(m)
        series.append(p)
        self.current_job, self.last = m.job, m
        self.totals.add(m)
        return "metrics", {"job": m.job, "point": p}

    def on_event(self, e: Event) -> Update | None:
        if not self.seen_events.first((e.kind, e.job, e.step, e.worker_id, e.cause, e.at)):
            return None
        self.totals.events[e.kind] += 1
        if e.kind == "waiting_for_workers":
            self.waits[e.job] = e
        if e.worker_id:
            dev = self.devices.setdefault(e.worker_id, DeviceRow(e.worker_id))
            if e.kind == "worker_lost":
                dev.lost_at = e.at
        view = e.model_dump()
        for k in ("at", "detect_s", "redispatch_s", "complete_s"):
            view[k] = finite(view[k])
        view["detail"] = {k: finite(v) if isinstance(v, float) else v for k, v in e.detail.items()}
        series = self.jobs.get(e.job or self.current_job or "")
        view["after_step"] = series[-1]["step"] if series else None  # where the timeline marks it
        self.events.append(view)
        return "event", view

    def on_device(self, rec: DeviceRecord) -> Update:
        self.devices.setdefault(rec.worker_id, DeviceRow(rec.worker_id)).update(rec)
        return "device", {"worker_id": rec.worker_id}

    def on_device_gone(self, worker_id: str, at: float) -> Update:
        dev = self.devices.setdefault(worker_id, DeviceRow(worker_id))
        if dev.lost_at is None:
            dev.lost_at = at
        return "device", {"worker_id": worker_id}

    def on_job_record(self, rec: JobRecord) -> Update:
        view = {k: getattr(rec, k) for k in ("job_id", "state", "submitted_at", "started_at", "ended_at", "runs",
                                             "exit_code", "reason", "min_workers", "heard_at")}
        self.queue[rec.job_id] = view
        return "queue", view

    def on_job_gone(self, job_id: str) -> Update:
        """The hub's record of the job was deleted (`cleave forget`; the runner's trimming of old refusals): it
        leaves the queue, and its curve, its PS's words and every event naming it go too, as they went from the
        hub ("forgotten": pages draw themselves again). The totals keep counting what was seen."""
        self.queue.pop(job_id, None)
        self.waits.pop(job_id, None)
        if self.jobs.pop(job_id, None) is None and not any(e["job"] == job_id for e in self.events):
            return "queue", {"job_id": job_id}
        self.events = deque((e for e in self.events if e["job"] != job_id), maxlen=self.events.maxlen)
        if self.current_job == job_id:  # the job of the latest step left: the one of the latest step kept
            self.current_job = max(self.jobs, key=lambda j: self.jobs[j][-1]["at"], default=None)
        if self.last is not None and self.last.job == job_id:
            self.last = None
        return "forgotten", {"job_id": job_id}

    def queue_view(self, now: float) -> list[dict]:
        """The hub's submitted jobs, the oldest submission first; `runner_silent_s` of a queued or running job
        whose runner has not stamped its record for RUNNER_SILENT_S (its runner is gone), else None;
        `waiting_for_workers` of a running job whose PS has no worker to deal to (as `cleave status` says it)."""
        return [{**j, "runner_silent_s": runner_silent_s(j["state"], j["heard_at"], now),
                 "waiting_for_workers": waiting_for_workers(j["state"], self.waits.get(j["job_id"]),
                                                            self.last_at(j["job_id"]), j["started_at"], now)}
                for j in sorted(self.queue.values(), key=lambda j: j["submitted_at"])]

    def last_at(self, job: str) -> float | None:
        """When the job's PS last reported a step (None: none seen)."""
        series = self.jobs.get(job)
        return series[-1]["at"] if series else None

    def on_plan(self, plan: Plan) -> Update:
        self.plan = plan
        return "plan", self.plan_view() or {}

    # ---- views ----------------------------------------------------------------------------------------
    def series(self, job: str | None = None) -> list[dict]:
        return list(self.jobs.get(job or self.current_job or "", ()))

    def job_list(self) -> list[dict]:
        return [
            {
                "job": j,
                "steps": len(s),
                "last_step": s[-1]["step"],
                "last_loss": s[-1]["loss"],
                "first_at": s[0]["at"],
                "last_at": s[-1]["at"],
            }
            for j, s in self.jobs.items()
            if s
        ]

    def measured_step_s(self) -> float | None:
        """The median step time of the latest steps of the current job (since the current plan)."""
        pts = self.series()
        if self.plan is not None:
            pts = [p for p in pts if p["at"] >= self.plan.created_at] or pts
        times = [p["step_time_s"] for p in pts[-MEASURED_WINDOW:] if p["step_time_s"] is not None]
        return statistics.median(times) if times else None

    def plan_view(self) -> dict | None:
        p = self.plan
        if p is None:
            return None
        return {
            "version": p.version,
            "created_at": p.created_at,
            "reason": p.reason,
            "devices": [w.worker_id for w in p.workers],
            "tile_rows": p.tile_rows,
            "tile_cols": p.tile_cols,
            "predicted_step_s": p.predicted_step_s,  # the planner's: the GEMMs only
            # the PS's: the plan's GEMMs plus its own work outside them (embeddings, attention, optimizer)
            "predicted_with_ps_s": next((q["predicted_step_s"] for q in reversed(self.series())
                                         if q.get("predicted_step_s") is not None), None),
            "measured_step_s": self.measured_step_s(),
        }

    def device_counts(self, now: float) -> Counter[str]:
        return Counter(d.state(now, self.stale_s) for d in self.devices.values())

    def fleet(self, now: float) -> dict:
        """Devices with profile, liveness, share of tiles and throughput; the busiest first, capped."""
        total_tiles = sum(d.tiles_done for d in self.devices.values())
        planned = {w.worker_id for w in self.plan.workers} if self.plan else set()
        order = {"live": 0, "joining": 1, "stale": 2, "lost": 3}
        devs = sorted(
            self.devices.values(),
            key=lambda d: (order[d.state(now, self.stale_s)], -d.tiles_done, d.worker_id),
        )
        rows = [self._device_row(d, now, total_tiles, planned) for d in devs[: self.fleet_rows]]
        return {"counts": dict(self.device_counts(now)), "total": len(self.devices), "devices": rows}

    def _device_row(self, d: DeviceRow, now: float, total_tiles: int, planned: set[str]) -> dict:
        prof = d.profile.model_dump() if d.profile else None
        return {
            "worker_id": d.worker_id,
            "state": d.state(now, self.stale_s),
            "in_plan": d.worker_id in planned,
            "profile": prof,
            "tiles_done": d.tiles_done,
            "share": d.tiles_done / total_tiles if total_tiles else 0.0,
            "tiles_per_s": d.tiles_per_s,
            "first_seen": d.first_seen,
            "last_seen": d.last_seen,
            "lost_at": d.lost_at,
        }

    def status(self, now: float) -> dict:
        """What changes slowly or with the clock: fleet, plan, totals (pushed to pages on a timer)."""
        return {
            "now": now,
            "fleet": self.fleet(now),
            "plan": self.plan_view(),
            "totals": self.totals.view(),
            "rejected": self.rejected,
            "queue": self.queue_view(now),
        }

    def snapshot(self, now: float, job: str | None = None) -> dict:
        """Everything a page needs to draw itself from scratch (GET /api/state, the stream's first message)."""
        job = job if job in self.jobs else self.current_job
        return {
            **self.status(now),
            "job": job,
            "jobs": self.job_list(),
            "series": self.series(job),
            "events": list(self.events),
            "stale_s": self.stale_s,
        }
