"""Prometheus exposition of the monitor's state: `cleave_` prefix, base units, `_total` counters.

No series carries a per-worker label: a fleet of thousands would make thousands of series. Per-device
numbers are in the JSON API instead. Labels used: `direction` (down, up), `kind` (event kind), `state`
(device liveness); each has a handful of values.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from cleave_monitor.core import STEP_TIME_BUCKETS, MonitorState

CONTENT_TYPE = CONTENT_TYPE_LATEST
DEVICE_STATES = ("live", "joining", "stale", "lost")

COUNTERS = (  # (name without _total, Totals field, help)
    ("cleave_steps", "steps", "Training steps completed, all jobs."),
    ("cleave_tiles", "tiles", "GEMM tiles computed by the fleet."),
    ("cleave_tiles_resent", "tiles_resent", "Tiles sent again after a worker was lost or late."),
    ("cleave_tiles_dropped", "tiles_dropped", "Late or duplicate tile results dropped by the PS."),
    ("cleave_results_rejected", "results_rejected", "Malformed or invalid tile results rejected by the PS."),
    ("cleave_tokens", "tokens", "Training tokens processed."),
    (
        "cleave_recoveries",
        "recoveries",
        "Lost workers whose tiles were recomputed elsewhere within the step.",
    ),
)


class StateCollector(Collector):
    """Reads a MonitorState at scrape time (the state is the single source; nothing is double-counted)."""

    def __init__(self, state: MonitorState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        t = self.state.totals
        for name, attr, doc in COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(t, attr))
        wire = CounterMetricFamily(
            "cleave_wire_bytes", "Payload bytes between PS and workers.", labels=["direction"]
        )
        wire.add_metric(["down"], t.bytes_down)
        wire.add_metric(["up"], t.bytes_up)
        yield wire
        events = CounterMetricFamily("cleave_events", "Fleet and job events, by kind.", labels=["kind"])
        for kind, n in sorted(t.events.items()):
            events.add_metric([kind], n)
        yield events
        yield CounterMetricFamily(
            "cleave_monitor_messages_rejected",
            "Stream messages the monitor could not decode.",
            value=self.state.rejected,
        )
        buckets = [
            (floatToGoString(le), n) for le, n in zip(STEP_TIME_BUCKETS, t.step_time_buckets, strict=True)
        ]
        yield HistogramMetricFamily(
            "cleave_step_duration_seconds",
            "Wall time of a training step.",
            buckets=buckets,
            sum_value=t.step_time_sum_s,
        )
        yield from self._gauges()

    def _gauges(self) -> Iterator[Metric]:
        s, last = self.state, self.state.last
        if last is not None:
            yield GaugeMetricFamily("cleave_step", "Index of the latest step.", value=last.step)
            yield GaugeMetricFamily("cleave_loss", "Training loss of the latest step.", value=last.loss)
            yield GaugeMetricFamily(
                "cleave_workers", "Workers that took part in the latest step.", value=last.workers
            )
            yield GaugeMetricFamily(
                "cleave_learning_rate", "Learning rate of the latest step.", value=last.lr
            )
            if last.dp_epsilon is not None:
                yield GaugeMetricFamily("cleave_dp_epsilon", "Epsilon a DP job has spent up to its latest round.",
                                        value=last.dp_epsilon)
        val = next((p["val_loss"] for p in reversed(s.series()) if p["val_loss"] is not None), None)
        if val is not None:
            yield GaugeMetricFamily("cleave_val_loss", "Latest validation loss.", value=val)
        devices = GaugeMetricFamily(
            "cleave_devices", "Devices known to the monitor, by liveness.", labels=["state"]
        )
        counts = s.device_counts(time.time())
        for state in DEVICE_STATES:
            devices.add_metric([state], counts.get(state, 0))
        yield devices
        plan = s.plan_view()
        if plan is not None:
            yield GaugeMetricFamily(
                "cleave_plan_version", "Version of the current plan.", value=plan["version"]
            )
            yield GaugeMetricFamily(
                "cleave_plan_devices", "Devices the current plan uses.", value=len(plan["devices"])
            )
            if plan["predicted_step_s"] is not None:
                yield GaugeMetricFamily(
                    "cleave_plan_predicted_step_seconds",
                    "Time the plan predicts for the step's GEMMs.",
                    value=plan["predicted_step_s"],
                )
            if plan["predicted_with_ps_s"] is not None:
                yield GaugeMetricFamily(
                    "cleave_predicted_step_seconds",
                    "Predicted step time: the plan's GEMMs plus the PS's own work outside them.",
                    value=plan["predicted_with_ps_s"],
                )
            if plan["measured_step_s"] is not None:
                yield GaugeMetricFamily(
                    "cleave_plan_measured_step_seconds",
                    "Median step time measured under the current plan.",
                    value=plan["measured_step_s"],
                )


def render(state: MonitorState) -> bytes:
    """The Prometheus text format of `state`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(state))
    return generate_latest(registry)
