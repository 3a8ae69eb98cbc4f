"""Cost models of the edge-training baselines the published comparison uses, each with its memory model and
the recovery a device failure costs it (pure arithmetic over the fleet's profiles).

- `alpa`: Alpa-style intra-operator parallelism over one mesh of p devices. Per GEMM, the best of a
  sqrt(p) x sqrt(p) 2-D split, a row split (weights replicated) and a column split (the input gathered);
  no overlap of communication and compute; backward = 2x forward, plus the weight-gradient all-reduce a
  row split needs.
- `dp_tp`: a data-parallel x tensor-parallel grid (Megatron-style, tensor width >= 16): four activation
  all-reduces per layer inside a tensor group, one gradient all-reduce across replicas.
- `dtfm`, `asteroid`, `pipeline`: pipelines, in `cleave.sim.pipelines`.

Every system chooses its configuration on the profiles the devices declared and is timed on their actual
ones; one that cannot fit the model in some device's memory is `feasible=False` with no step time, and
`unconstrained_step_s` says what it would take if memory were no object (the published cost models do not
check memory). Recovery is what a failure costs once noticed: re-partition, reload the lost device's state,
replay the lost work (`REPLAY_FRACTION` of a step, on average half of it for a failure at a random moment
of a synchronous step); `cleave.sim.systems.compare` adds the time to notice (a heartbeat timeout), which
Cleave's simulated recovery includes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cleave.sim.workload import STATE_FACTOR, WORK_FACTOR, Ring, Workload, ring_bytes

REPLAY_FRACTION = 0.5  # of a step, lost on average by a failure at a random moment of a synchronous step
MIN_TENSOR_WIDTH = 16


@dataclass(frozen=True)
class SystemResult:
    """One system on one job and fleet: `feasible`, and if so its step time, recovery and traffic."""

    name: str
    feasible: bool
    step_s: float | None
    recovery_s: float | None
    per_device_down_bytes: float | None
    per_device_up_bytes: float | None
    devices_used: int
    memory_bytes: float | None = None  # the most any device needs
    unconstrained_step_s: float | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "feasible": self.feasible,
            "recovery_s": self.recovery_s,
            "per_device_down_bytes": self.per_device_down_bytes,
            "per_device_up_bytes": self.per_device_up_bytes,
            "devices_used": self.devices_used,
            "memory_bytes": self.memory_bytes,
            "unconstrained_step_s": self.unconstrained_step_s,
            "note": self.note,
            **self.extra,
        }


@dataclass(frozen=True)
class Config:
    """A candidate configuration: its step time, traffic, memory and recovery, as computed."""

    step_s: float
    traffic: float  # bytes each device sends (= receives) per step
    memory: float
    recovery_s: float
    devices: int
    note: str


def pick(name: str, configs: list[Config], budget: float) -> SystemResult:
    """The fastest configuration that fits `budget` bytes per device (and the fastest regardless)."""
    if not configs:
        return SystemResult(name, False, None, None, None, None, 0, note="no configuration applies")
    fastest = min(configs, key=lambda c: c.step_s)
    fits = [c for c in configs if c.memory <= budget]
    if not fits:
        lean = min(configs, key=lambda c: c.memory)
        return SystemResult(
            name,
            False,
            None,
            None,
            None,
            None,
            0,
            lean.memory,
            fastest.step_s,
            f"needs {lean.memory / 2**20:.0f} MiB a device at best ({lean.note}); "
            f"devices have {budget / 2**20:.0f} MiB",
            unconstrained(fastest),
        )
    c = min(fits, key=lambda c: c.step_s)
    return SystemResult(
        name,
        True,
        c.step_s,
        c.recovery_s,
        c.traffic,
        c.traffic,
        c.devices,
        c.memory,
        fastest.step_s,
        c.note,
        unconstrained(fastest),
    )


def unconstrained(c: Config) -> dict[str, Any]:
    """The fastest configuration regardless of memory: what the published cost models report."""
    return {
        "unconstrained_recovery_s": c.recovery_s,
        "unconstrained_devices": c.devices,
        "unconstrained_down_bytes": c.traffic,
    }


def by_uplink(declared: Ring) -> np.ndarray:
    """Devices ordered best-connected first (peer traffic leaves through uplinks, the scarce resource)."""
    return np.argsort(-np.minimum(declared.up, declared.down), kind="stable")


# ---- Alpa-style intra-operator parallelism ------------------------------------------------------------------
def _splits(w: Workload, k: int, n: int, g: int, mesh: Ring) -> dict[str, tuple[float, float, float]]:
    """Per split of one forward GEMM: (seconds of a step's fwd + bwd, bytes each device sends in them,
    working-set bytes)."""
    M, b, p = w.tokens, w.dtype_bytes, g * g
    fmin = float(mesh.flops.min())
    a_rows, w_cols = M / g * k * b, k * n / g * b
    two_d = (
        3 * (mesh.allgather_s(a_rows, g) + mesh.allgather_s(w_cols, g) + 2 * (M / g) * (n / g) * k / fmin),
        3 * (ring_bytes(a_rows, g) + ring_bytes(w_cols, g)),
        a_rows / g + w_cols + (M / g) * (n / g) * b,
    )
    row = (
        3 * 2 * (M / p) * n * k / fmin + mesh.allreduce_s(k * n * b, p),
        2 * ring_bytes(k * n * b, p),
        (M / p * k + k * n + M / p * n) * b,
    )
    col = (
        3 * (mesh.allgather_s(M * k * b, p) + 2 * M * (n / p) * k / fmin),
        3 * ring_bytes(M * k * b, p),
        (M * k + k * n / p + M * n / p) * b,
    )
    return {"2d": two_d, "row": row, "col": col}


def _alpa_mesh(w: Workload, mesh: Ring, g: int, budget: float) -> tuple[Config, Config]:
    """(the fastest plan that fits, the fastest plan) on a g x g mesh; each GEMM picks its split."""
    p, b = g * g, w.dtype_bytes
    base = STATE_FACTOR * b * w.units[0].params / p + w.cfg.n_layer * w.layer_input_bytes / p
    choices = []  # per GEMM kind: (step s, bytes sent, working set, persistent bytes, name)
    for k, n, count in w.fwd_gemms:
        shard = {"2d": k * n / p, "row": k * n, "col": k * n / p}
        choices.append(
            [
                (count * t, count * sent, work, STATE_FACTOR * b * shard[name] * count, name)
                for name, (t, sent, work) in _splits(w, k, n, g, mesh).items()
            ]
        )

    def total(sel: list[tuple]) -> Config:
        step = sum(c[0] for c in sel)
        persist = base + sum(c[3] for c in sel)
        memory = persist + max(c[2] for c in sel)
        recovery = persist / float(np.median(mesh.down)) + REPLAY_FRACTION * step
        names = ",".join(sorted({c[4] for c in sel}))
        return Config(step, sum(c[1] for c in sel), memory, recovery, p, f"mesh {g}x{g}, splits {names}")

    fastest = total([min(opts, key=lambda c: c[0]) for opts in choices])
    lean = [min(opts, key=lambda c: (c[3] + c[2], c[0])) for opts in choices]
    for i in sorted(
        range(len(choices)), key=lambda i: lean[i][0] - min(c[0] for c in choices[i]), reverse=True
    ):
        for cand in sorted(choices[i], key=lambda c: c[0]):
            trial = lean[:i] + [cand] + lean[i + 1 :]
            if cand[0] < lean[i][0] and total(trial).memory <= budget:
                lean = trial
                break
    return total(lean), fastest


def alpa(w: Workload, declared: Ring, actual: Ring, budget: float) -> SystemResult:
    """Alpa-style intra-operator parallelism on the best square mesh of at most the fleet's devices."""
    order = by_uplink(declared)
    fits, every = [], []
    for g in range(1, math.isqrt(len(order)) + 1):
        c, fast = _alpa_mesh(w, actual.take(order[: g * g]), g, budget)
        fits.append(c)
        every.append(fast)
    res = pick("alpa", fits, budget)
    best = min(every, key=lambda c: c.step_s)
    return SystemResult(
        res.name,
        res.feasible,
        res.step_s,
        res.recovery_s,
        res.per_device_down_bytes,
        res.per_device_up_bytes,
        res.devices_used,
        res.memory_bytes,
        best.step_s,
        res.note,
        unconstrained(best),
    )


# ---- data parallel x tensor parallel --------------------------------------------------------------------------
def _dp_tp(w: Workload, mesh: Ring, t: int, d: int) -> Config:
    b, h, L = w.dtype_bytes, w.cfg.n_embd, w.cfg.n_layer
    act = w.tokens / d * h * b  # one layer's activations in a replica
    compute = w.step_flops / (t * d) / float(mesh.flops.min())
    tp = 4 * L * mesh.allreduce_s(act, t)
    shard = w.params / t * b
    dp = mesh.allreduce_s(shard, d)
    step = compute + tp + dp
    sent = 4 * L * 2 * ring_bytes(act, t) + 2 * ring_bytes(shard, d)
    memory = STATE_FACTOR * shard + L * act / t + WORK_FACTOR * (w.tokens / d) * h * (b / 2) / t
    peer = float(np.median(np.minimum(mesh.up, mesh.down))) if d > 1 else float(np.median(mesh.down))
    recovery = STATE_FACTOR * shard / peer + REPLAY_FRACTION * step
    return Config(step, sent, memory, recovery, t * d, f"tensor {t} x data {d}")


def dp_tp(w: Workload, declared: Ring, actual: Ring, budget: float) -> SystemResult:
    """The best grid of tensor width t >= 16 (powers of two, or the whole fleet) and d = N // t replicas."""
    n = len(declared)
    widths = sorted(
        {t for t in (2**i for i in range(4, 15)) if t <= n} | ({n} if n >= MIN_TENSOR_WIDTH else set())
    )
    order = by_uplink(declared)
    configs = []
    for t in widths:
        d = max(1, min(n // t, w.batch))
        configs.append(_dp_tp(w, actual.take(order[: t * d]), t, d))
    return pick("dp_tp", configs, budget)
