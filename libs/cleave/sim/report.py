"""The evaluation report: sweep models and fleet sizes, compare every system, check the published claims
point by point, and write `report.json` and PNG plots (`cleave sim --report DIR`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from cleave.errors import ConfigError
from cleave.sim.systems import SimConfig, compare

DEFAULT_MODELS = ("opt-350m", "opt-1.3b", "opt-13b", "llama2-7b")
DEFAULT_DEVICES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
BASE_EXTRA_DEVICES = (10000,)  # the base model only (the PS's ledger is O(devices^2) per GEMM)
CHURN_RATES = (0.0, 0.1, 0.5, 1.0)  # leaves per device-hour, at the base model
CHURN_EXTRA_DEVICES = (1024,)  # churn on larger fleets than the base one (4,096 takes about 15 minutes)


@dataclass(frozen=True)
class ReportSpec:
    """What to sweep: the models, the fleet sizes, the churn rates and the fleets they are simulated on.
    `base` is the base point: the report compares recovery there, runs the churn curve on its model (on its
    fleet size and `churn_extra_devices`), and runs its model on `base_extra_devices` too."""

    base: SimConfig
    models: tuple[str, ...] = DEFAULT_MODELS
    devices: tuple[int, ...] = DEFAULT_DEVICES
    base_extra_devices: tuple[int, ...] = BASE_EXTRA_DEVICES
    churn_rates: tuple[float, ...] = CHURN_RATES
    churn_extra_devices: tuple[int, ...] = CHURN_EXTRA_DEVICES

    @classmethod
    def of(cls, base: SimConfig, models: str | None = None, devices: str | None = None) -> ReportSpec:
        """The sweep of `--report-models` and `--report-devices` (comma-separated; None: the full sweep) from
        the point `base`. A chosen list of sizes drops the extra fleets. The base point is `base`'s model and
        fleet size where the sweep has them, else the sweep's first model and its largest fleet size."""
        spec = cls(base)
        if models is not None:
            names = tuple(dict.fromkeys(m.strip() for m in models.split(",") if m.strip()))
            if not names:
                raise ConfigError(f"--report-models {models!r}: expected comma-separated models")
            spec = replace(spec, models=names)
        if devices is not None:
            try:
                sizes = tuple(sorted({int(d) for d in devices.split(",") if d.strip()}))
            except ValueError:
                sizes = ()
            if not sizes or sizes[0] < 1:
                raise ConfigError(
                    f"--report-devices {devices!r}: expected comma-separated fleet sizes of at least 1"
                )
            spec = replace(spec, devices=sizes, base_extra_devices=(), churn_extra_devices=())
        model = base.model if base.model in spec.models else spec.models[0]
        n = base.devices if base.devices in spec.devices + spec.base_extra_devices else max(spec.devices)
        return replace(spec, base=replace(base, model=model, devices=n))

    def sweep_configs(self) -> list[SimConfig]:
        """Every (model, fleet size) of the sweep, without churn."""
        return [
            replace(self.base, model=m, devices=n, churn=0.0, steps=1)
            for m in self.models
            for n in self.devices + (self.base_extra_devices if m == self.base.model else ())
        ]

    def churn_configs(self) -> list[SimConfig]:
        """The base model at every churn rate, on the base fleet size and each of `churn_extra_devices`."""
        return [
            replace(self.base, devices=n, churn=rate, steps=1)
            for n in dict.fromkeys((self.base.devices, *self.churn_extra_devices))
            for rate in self.churn_rates
        ]


def _compare_all(
    cfgs: list[SimConfig], progress: TextIO | None, done: int = 0, total: int | None = None
) -> list[dict[str, Any]]:
    """`compare` at each point, a line of progress as each starts and ends (point `done + 1` of `total`)."""
    docs = []
    for i, cfg in enumerate(cfgs, done + 1):
        if progress:
            progress.write(
                f"[{i}/{total or len(cfgs)}] sim {cfg.model} on {cfg.devices} devices, churn {cfg.churn}"
                "/device-hour ... "
            )
            progress.flush()
        t0 = time.perf_counter()
        docs.append(compare(cfg))
        if progress:
            progress.write(f"{time.perf_counter() - t0:.1f} s\n")
            progress.flush()
    return docs


def sweep(spec: ReportSpec, progress: TextIO | None = None, total: int | None = None) -> list[dict[str, Any]]:
    """Every system at every (model, fleet size): one `compare` document each, without churn."""
    cfgs = spec.sweep_configs()
    return [
        {"model": c.model, "devices": c.devices, "systems": doc["systems"], "params": doc["config"]["params"]}
        for c, doc in zip(cfgs, _compare_all(cfgs, progress, 0, total), strict=True)
    ]


def churn_curve(
    spec: ReportSpec, progress: TextIO | None = None, done: int = 0, total: int | None = None
) -> list[dict[str, Any]]:
    """Every system at every churn rate, on the base fleet and on each of `churn_extra_devices`."""
    cfgs = spec.churn_configs()
    return [
        {"churn": c.churn, "devices": c.devices, "systems": doc["systems"]}
        for c, doc in zip(cfgs, _compare_all(cfgs, progress, done, total), strict=True)
    ]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _span(values: list[float]) -> dict[str, Any]:
    return {"min": min(values), "max": max(values), "points": len(values)} if values else {"points": 0}


def _time_ratios(points: list[dict[str, Any]], systems: list[str], key: str) -> dict[str, Any]:
    """Per baseline: its `key` time over Cleave's where both have one (the baseline feasible for "step_s")."""
    out = {}
    for name in systems:
        ratios = []
        for p in points:
            c, r = p["systems"]["cleave"], p["systems"][name]
            if c["feasible"] and (r["feasible"] or key != "step_s"):
                ratios.append(_ratio(r[key], c["step_s"]))
        out[name] = _span([x for x in ratios if x is not None])
    return out


def _traffic(points: list[dict[str, Any]], model: str) -> dict[str, Any]:
    rows = [
        (
            p["devices"],
            p["systems"]["cleave"]["per_device_down_bytes"],
            p["systems"]["cleave"]["per_device_up_bytes"],
        )
        for p in points
        if p["model"] == model and p["systems"]["cleave"]["feasible"]
    ]
    falls = all(b[1] <= a[1] and b[2] <= a[2] for a, b in zip(rows, rows[1:], strict=False))
    return {"per_device": rows, "falls_as_devices_join": falls}


def _recovery(points: list[dict[str, Any]], base: SimConfig) -> dict[str, Any]:
    """Recovery per system at the base point (a baseline that does not fit: its memory-blind configuration);
    Cleave's is its mean over a step's GEMMs, and its worst GEMM kind's."""
    at_base = next((p for p in points if p["model"] == base.model and p["devices"] == base.devices), None)
    if at_base is None:
        return {}
    cleave = at_base["systems"]["cleave"]
    mine, worst = cleave["recovery_s"], (cleave.get("recovery") or {}).get("worst_s")
    out = {}
    for s, r in at_base["systems"].items():
        value = r["recovery_s"] if r["feasible"] else r.get("unconstrained_recovery_s")
        out[s] = {
            "recovery_s": value,
            "feasible": r["feasible"],
            "vs_cleave": _ratio(value, mine),
            "vs_cleave_worst": _ratio(value, worst),  # against Cleave's slowest GEMM kind to recover
        }
    out["cleave"]["worst_s"] = worst
    return out


def _ps_bill(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, fleet): what bounds one PS's step, and the PS replicas the job needs (`cleave.sim.ps`)."""
    rows = []
    for p in points:
        c = p["systems"]["cleave"]
        ps = c.get("ps")
        if not c["feasible"] or not ps:
            continue
        best = ps["with_replicas"]
        rows.append({
            "model": p["model"], "devices": p["devices"], "bound": ps["bound"], "time_bound": ps["time_bound"],
            "step_s": c["step_s"], "ps_compute_s": ps["compute_s"], "ps_egress_s": ps["egress_s"],
            "fleet_s": ps["fleet_s"], "ps_memory_bytes": ps["memory_bytes"]["total"],
            "replicas_by_memory": ps["replicas_by_memory"], "replicas": ps["replicas"],
            "step_s_with_replicas": best["step_s"] if best else None,
            "allreduce_s": best["allreduce_s"] if best else None,
        })
    return rows


def claims(points: list[dict[str, Any]], base: SimConfig) -> dict[str, Any]:
    """The published claims, checked against the sweep."""
    systems = [s for s in points[0]["systems"] if s != "cleave"] if points else []
    models = list(dict.fromkeys(p["model"] for p in points))
    largest = {
        m: {
            s: max(
                (
                    p["systems"][s]["devices_used"]
                    for p in points
                    if p["model"] == m and p["systems"][s]["feasible"]
                ),
                default=0,
            )
            for s in ["cleave", *systems]
        }
        for m in models
    }
    return {
        "time_ratio_vs_cleave": _time_ratios(points, systems, "step_s"),
        "time_ratio_vs_cleave_ignoring_memory": _time_ratios(points, systems, "unconstrained_step_s"),
        "largest_fleet": largest,
        "traffic": {m: _traffic(points, m) for m in models},
        "recovery_at_base": _recovery(points, base),
        "ps": _ps_bill(points),
    }


def write_report(spec: ReportSpec, out_dir: Path, progress: TextIO | None = None) -> dict[str, Any]:
    """Run the sweep and the churn curve; write report.json and the plots into `out_dir`."""
    from cleave.sim import plots

    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    total = len(spec.sweep_configs()) + len(spec.churn_configs())
    points = sweep(spec, progress, total)
    churn = churn_curve(spec, progress, len(points), total)
    doc: dict[str, Any] = {
        "spec": {**asdict(spec), "base": asdict(spec.base)},
        "points": points,
        "churn": churn,
        "claims": claims(points, spec.base),
    }
    doc["files"] = plots.draw(doc, out_dir)
    doc["wall_s"] = time.perf_counter() - t0
    (out_dir / "report.json").write_text(json.dumps(doc, indent=1, default=float))
    doc["files"].append(str(out_dir / "report.json"))
    return doc
