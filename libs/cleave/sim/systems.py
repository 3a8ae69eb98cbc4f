"""One comparison: Cleave (simulated step by step on the fleet) and the baselines (cost models) on the same
job, fleet, churn and stragglers; the JSON that `cleave sim --json` prints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from cleave.errors import ConfigError, FleetGone, PlanError
from cleave.gemm.dealer import Policy
from cleave.gemm.tiles import DEFAULT_CHUNKS
from cleave.plan.fleet import Fleet, fleet_from_spec, load_fleet, synthetic_fleet
from cleave.sim.baselines import SystemResult, alpa, dp_tp
from cleave.sim.pipelines import asteroid, dtfm, pipeline
from cleave.sim.ps import DEFAULT_PS_FLOPS, DEFAULT_PS_LINK, DEFAULT_PS_MEMORY, PsSpec, charge
from cleave.sim.step import Simulation, StepStats, recovery_over_step
from cleave.sim.workload import Ring, Workload
from cleave.sim.world import World

Baseline = Callable[[Workload, Ring, Ring, float], SystemResult]
BASELINES: dict[str, Baseline] = {
    "alpa": alpa,
    "dp_tp": dp_tp,
    "dtfm": dtfm,
    "asteroid": asteroid,
    "pipeline": pipeline,
}
SYSTEMS = ("cleave", *BASELINES)


# The PS's egress is what one PS process sends, not its VM's NIC: benchmarks/results/ps_rate.json measures
# 0.69 ns of the PS's CPU a byte it moves (sent + received, in its steady state: outputs in reused memory);
# results come back at 19% of the bytes sent at the default point, so a PS with a core of its own sends
# 1 / (0.69e-9 x 1.19) = 1.2e9 bytes/s (9.7 Gbit/s). tests/unit/test_sim_ps.py holds it to those committed
# measurements.
DEFAULT_PS_BANDWIDTH = 1.2e9
DEFAULT_FLEET_SIZE = 256  # devices of `--fleet synthetic` without --devices


@dataclass(frozen=True)
class SimConfig:
    """One simulated job on one fleet (the `cleave sim` flags)."""

    model: str = "opt-13b"
    devices: int = DEFAULT_FLEET_SIZE
    fleet: str = "synthetic"  # or the path of a fleet file (its first `devices` devices); `fleet_spec` reads --fleet
    batch: int = 128
    seq: int = 1024
    dtype: str = "fp16"
    churn: float = 0.0  # leaves per device-hour (joins keep the expected fleet size)
    stragglers: float = 0.0  # fraction of devices with compute and links x 0.1
    hidden_stragglers: bool = False  # they register their full profile (the planner is not told)
    seed: int = 0
    steps: int = 1
    memory_bytes: int | None = None  # every device's memory (default: the fleet's)
    ps_bandwidth: float | None = DEFAULT_PS_BANDWIDTH  # the PS's egress, bytes/s (None: unlimited, as published)
    tile: tuple[int, int] | None = None  # cut planned blocks into tiles of at most this (default: whole)
    chunks: int = DEFAULT_CHUNKS  # a planned block goes out in at least this many pieces, streamed
    window: int = 1  # tiles in flight per worker beyond its planned pieces (1: stealing waits for idle workers)
    replan_every_s: float = 0.0  # > 0: recompute the planner's layout at most this often
    fan_out: bool = True  # shared blocks published once to their group, as the PS does
    deferred: int = 0  # weight gradients dealt beside the input gradients (`Simulation.deferred`; 0: one at a time)
    ps_flops: float = DEFAULT_PS_FLOPS  # the PS's FLOP/s for its own work (attention, norms, loss, optimizer)
    ps_memory: float = DEFAULT_PS_MEMORY  # one PS machine's memory, bytes
    ps_link: float = DEFAULT_PS_LINK  # bytes/s between PS replicas (their gradient all-reduce)
    systems: tuple[str, ...] = SYSTEMS


def fleet_spec(spec: str, devices: int | None, seed: int = 0) -> tuple[str, int]:
    """`SimConfig.fleet` and `.devices` of `--fleet SPEC --devices N`. SPEC is what `cleave plan --fleet` takes
    (`synthetic:N` or a fleet file, read by the same code), or `synthetic`: N of the edge profile, N from
    --devices (DEFAULT_FLEET_SIZE without). Without --devices a fleet file is taken whole; with it, its first N."""
    if spec == "synthetic":
        return spec, DEFAULT_FLEET_SIZE if devices is None else devices
    size = len(fleet_from_spec(spec, seed))
    if not spec.startswith("synthetic:"):
        return spec, size if devices is None else devices  # build_fleet refuses more than the file holds
    if devices not in (None, size):
        raise ConfigError(f"--devices {devices} disagrees with --fleet {spec}: give the fleet's size once")
    return "synthetic", size


def build_fleet(cfg: SimConfig) -> Fleet:
    if cfg.fleet == "synthetic":
        fleet = synthetic_fleet(cfg.devices, cfg.seed)
    else:
        fleet = load_fleet(cfg.fleet)
        if cfg.devices > len(fleet):
            raise ConfigError(
                f"--devices {cfg.devices}: the fleet file {cfg.fleet} has only {len(fleet)} devices"
            )
        fleet = fleet.take(np.arange(cfg.devices))
    if cfg.memory_bytes is not None:
        fleet = Fleet(
            fleet.ids,
            fleet.flops,
            np.full(len(fleet), cfg.memory_bytes, dtype=np.int64),
            fleet.downlink,
            fleet.uplink,
            fleet.latency,
        )
    return fleet


def build_world(cfg: SimConfig) -> World:
    return World.build(
        build_fleet(cfg),
        stragglers=cfg.stragglers,
        hidden_stragglers=cfg.hidden_stragglers,
        churn_per_hour=cfg.churn,
        seed=cfg.seed,
        synthetic=cfg.fleet == "synthetic",
    )


def simulation(cfg: SimConfig, work: Workload, world: World) -> Simulation:
    policy = Policy(window=cfg.window)
    return Simulation(
        world,
        work.shapes,
        work.dtype_bytes,
        "cost",
        cfg.tile,
        cfg.ps_bandwidth,
        policy,
        replan_every_s=cfg.replan_every_s,
        chunks=cfg.chunks,
        fan_out=cfg.fan_out,
        deferred=cfg.deferred,
    )


def per_device(stats: list[StepStats]) -> tuple[dict[int, float], dict[int, float]]:
    """Bytes down and up per device, averaged over the steps."""
    down: dict[int, float] = {}
    up: dict[int, float] = {}
    for st in stats:
        for mine, theirs in ((down, st.down), (up, st.up)):
            for d, v in theirs.items():
                mine[d] = mine.get(d, 0.0) + v / len(stats)
    return down, up


def predicted_step(sim: Simulation, work: Workload) -> tuple[float, float, float]:
    """On the starting fleet (the first layout): (what the scheduler predicts, `Plan.predicted_step_s`: the
    planner's blocks as the PS deals them and devices stream them; the planner's own overlapped ideal; the
    scheduler's prediction for the fleet alone, without the PS's egress limit)."""
    plan = sim.scheduler.plans[0]
    dealt = ideal = devices = 0.0
    for s in work.shapes:
        dealt += sim.cutter.tileset(0, plan, s.m, s.n, s.k)[1] * s.count_per_step
        gp = sim.cutter.gemm_plan(0, plan, s.m, s.n, s.k)
        ideal += gp.makespan_s * s.count_per_step
        devices += sim.cutter.dealt.get((0, s.m, s.n, s.k), gp.device_time_s) * s.count_per_step
    return dealt, ideal, devices


def charge_ps(cfg: SimConfig, work: Workload, gemm_step_s: float, ps_bytes: float, fleet_s: float) -> dict[str, Any]:
    """The PS's own bill for the simulated step and the replicas the job needs (`cleave.sim.ps.charge`)."""
    spec = PsSpec(cfg.ps_flops, cfg.ps_memory, cfg.ps_link)
    fleet = {"gemm_step_s": gemm_step_s, "ps_bytes": ps_bytes, "ps_bandwidth": cfg.ps_bandwidth or 0.0,
             "fleet_s": fleet_s}
    return charge(work, spec, fleet)


def run_cleave(cfg: SimConfig, work: Workload, world: World) -> SystemResult:
    """Cleave's steps, simulated; its recovery from losing the busiest device of a GEMM, in every GEMM kind."""
    t0 = time.perf_counter()
    sim = simulation(cfg, work, world)
    try:
        stats = [sim.step() for _ in range(cfg.steps)]
        calm = simulation(cfg, work, build_world(replace(cfg, churn=0.0, hidden_stragglers=False)))
        recovery = recovery_over_step(calm, work.shapes)
    except PlanError as e:
        return SystemResult(
            "cleave", False, None, None, None, None, 0, note=f"the planner found no plan: {e}"
        )
    except FleetGone as e:  # (every device of a GEMM left, and none joined in time)
        return SystemResult("cleave", False, None, None, None, None, 0, note=f"the fleet churned away: {e}")
    down, up = per_device(stats)
    predicted = predicted_step(sim, work)
    gemm_step = float(np.mean([st.step_s for st in stats]))
    ps_bytes = float(np.mean([st.ps_bytes for st in stats]))
    ps = charge_ps(cfg, work, gemm_step, ps_bytes, predicted[2])
    step = ps["step_s"]  # the GEMMs as simulated, then the PS's own work (autograd runs it between them)
    extra = {
        "gemm_step_s": gemm_step,
        "ps": ps,
        "predicted_step_s": predicted[0],
        "planner_ideal_step_s": predicted[1],
        "steps": [st.step_s + ps["compute_s"] for st in stats],
        "tiles": sum(st.tiles for st in stats),
        "tiles_resent": sum(st.resent for st in stats),
        "copied": sum(st.copied for st in stats),
        "duplicates": sum(st.duplicates for st in stats),
        "gemms_simulated": sum(st.gemms_simulated for st in stats),
        "plans": len(sim.scheduler.plans),
        "max_device_down_bytes": max(down.values()),
        "ps_bytes_per_step": ps_bytes,  # tiles, and fan-out blocks once
        "distinct_input_bytes": float(sum((s.m + s.n) * s.k * work.dtype_bytes * s.count_per_step for s in work.shapes)),
        "recovery": recovery,
        "sim_wall_s": time.perf_counter() - t0,
    }
    used = len(down)
    return SystemResult(
        "cleave",
        True,
        step,
        float(recovery["recovery_s"]),
        sum(down.values()) / used,
        sum(up.values()) / used,
        used,
        None,
        step,
        "planned blocks, dealt by the PS's dealing core; the PS's own work charged",
        extra,
    )


def links(p: Any) -> Ring:
    return Ring(p.flops, p.up, p.down, p.lat, p.mem)


def expected_step(step: float, recovery: float, failures_per_s: float) -> float | None:
    """A synchronous step when failures arrive at `failures_per_s` and each costs `recovery` seconds
    (noticing included): S' = S / (1 - rate x recovery), or never (None) when that is not below 1."""
    load = failures_per_s * recovery
    return step / (1 - load) if load < 1 else None


def with_detection(r: SystemResult, detect_s: float) -> SystemResult:
    """A baseline's recovery plus the seconds it takes to notice a failure (a heartbeat timeout)."""
    extra = dict(r.extra)
    if extra.get("unconstrained_recovery_s") is not None:
        extra["unconstrained_recovery_s"] += detect_s
    return replace(r, recovery_s=None if r.recovery_s is None else r.recovery_s + detect_s, extra=extra)


def with_churn(r: SystemResult, churn_per_hour: float) -> SystemResult:
    """A baseline with its expected step under `churn_per_hour` leaves per device-hour of the devices it
    uses (`step_s_with_churn`; `unconstrained_step_s_with_churn` for its memory-blind configuration)."""
    extra = dict(r.extra)
    if r.feasible and r.step_s is not None and r.recovery_s is not None:
        rate = churn_per_hour / 3600.0 * r.devices_used
        extra["step_s_with_churn"] = expected_step(r.step_s, r.recovery_s, rate)
    unc_rec = r.extra.get("unconstrained_recovery_s")
    if r.unconstrained_step_s is not None and unc_rec is not None:
        rate = churn_per_hour / 3600.0 * r.extra.get("unconstrained_devices", r.devices_used)
        extra["unconstrained_step_s_with_churn"] = expected_step(r.unconstrained_step_s, unc_rec, rate)
    return replace(r, extra=extra)


def compare(cfg: SimConfig, liveness_s: float = 1.0) -> dict[str, Any]:
    """Every system in `cfg.systems` on one job and fleet: the `cleave sim --json` document."""
    work = Workload.of(cfg.model, cfg.batch, cfg.seq, cfg.dtype)
    world = build_world(cfg)
    declared, actual = links(world.declared), links(world.actual)  # the starting fleet (churn adds to it)
    budget = float(world.declared.mem.min())
    out: dict[str, Any] = {}
    for name in cfg.systems:
        if name == "cleave":
            out[name] = run_cleave(cfg, work, world)
            continue
        r = BASELINES[name](work, declared, actual, budget)
        out[name] = with_churn(with_detection(r, liveness_s), cfg.churn)
    return {
        "config": {**asdict(cfg), "params": work.params, "step_flops": work.step_flops},
        "systems": {k: v.to_json() for k, v in out.items()},
    }


def parse_systems(text: str | Sequence[str]) -> tuple[str, ...]:
    names = tuple(s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip())
    bad = [n for n in names if n not in SYSTEMS]
    if not names:
        raise ConfigError(f"--systems names no system; choose from {', '.join(SYSTEMS)}")
    if bad:
        raise ConfigError(f"unknown system {', '.join(bad)}; choose from {', '.join(SYSTEMS)}")
    return names
