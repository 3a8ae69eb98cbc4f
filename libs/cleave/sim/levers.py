"""Levers on a simulated Cleave step: named variants of the default job (the workers' block cache, the
planner's pieces per block and largest tile, the bytes an element travels in), each run on the same world
and accounted by `cleave.sim.breakdown`, so that their effects compare side by side
(`benchmarks/sim_levers.py`).

A lever is data (`Lever`): the knobs it changes (GEMMs dealt concurrently among them: `deferred`), or
`build` (a function of the config, workload and world that returns the `Simulation` to run) for a lever
that needs a different simulation altogether, such as fused layers; add it to `LEVERS` (or pass a list of your own to `run_levers`) and it becomes one
more row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cleave.gemm.dealer import DEFAULT_CACHE_BYTES, Policy
from cleave.models import GemmShape
from cleave.sim.breakdown import step_breakdown
from cleave.sim.ps import ps_flops
from cleave.sim.step import Simulation
from cleave.sim.systems import SimConfig, build_world
from cleave.sim.workload import Workload
from cleave.sim.world import World

MiB = 2**20
Build = Callable[[SimConfig, Workload, World], Simulation]


@dataclass(frozen=True)
class Lever:
    """One variant of the job: what it changes (None: the default's)."""

    name: str
    what: str
    cache_bytes: int | None = None  # each worker's input-block cache
    chunks: int | None = None  # pieces a planned block goes out in (at least)
    tile: tuple[int, int] | None = None  # largest tile (rows, cols) a block is cut to
    dtype_bytes: int | None = None  # bytes an element travels in (2: fp16 or bf16; 1: 8-bit strips)
    fan_out: bool | None = None  # shared strips published once to their group
    copies: bool = True  # False: no speculative copies of late tiles (the PS's speculate_factor 0)
    deferred: int | None = None  # weight gradients dealt beside the input gradients (the PS's deferred_gemms)
    build: Build | None = None  # a simulation of its own (the other fields are then ignored)


LEVERS: tuple[Lever, ...] = (  # in the order the benchmark runs them: the likeliest levers first
    Lever("default", "the simulator's defaults: 128 MiB cache, 4 pieces a block, fp16 strips, fan-out"),
    Lever("cache 256 MiB", "the workers' block cache at 256 MiB (half the 512 MiB device)", cache_bytes=256 * MiB),
    Lever("cache 384 MiB", "the workers' block cache at 384 MiB (three quarters of it)", cache_bytes=384 * MiB),
    Lever("8-bit strips", "1 byte an element each way (int8; blockwise scales left out), approximate", dtype_bytes=1),
    Lever("8-bit + cache 384 MiB", "8-bit strips and a 384 MiB cache", cache_bytes=384 * MiB, dtype_bytes=1),
    Lever("fan-out off", "every strip travels with its tile (the published setting)", fan_out=False),
    Lever("8-bit + fan-out off", "8-bit strips, every strip with its tile", dtype_bytes=1, fan_out=False),
    Lever("chunks 1", "planned blocks sent whole (no streaming of pieces)", chunks=1),
    Lever("chunks 8", "planned blocks in at least 8 pieces", chunks=8),
    Lever("tile 1024", "blocks cut to tiles of at most 1,024 x 1,024 (the runtime's default tile)", tile=(1024, 1024)),
    Lever("fp32 strips", "4 bytes an element (the exact fp32 job's strips), for scale", dtype_bytes=4),
    Lever("no copies", "no speculative copies of late tiles", copies=False),
    Lever("8-bit + cache 384 MiB + no copies", "8-bit strips, a 384 MiB cache, no speculative copies",
          cache_bytes=384 * MiB, dtype_bytes=1, copies=False),
    Lever("deferred dW", "each layer's weight gradient dealt beside the input gradients, at most 8 waiting (the "
          "PS's default deferred_gemms)", deferred=8),
    Lever("8-bit + deferred dW", "8-bit strips and deferred weight gradients", dtype_bytes=1, deferred=8),
    Lever("fused inputs", "layers that read one input fused (Llama's q/k/v, gate/up: their strips reused)",
          build=lambda cfg, work, world: fused(cfg, work, world)),
)


SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # Llama's layers that read one input


def fused_shapes(shapes: Sequence[GemmShape]) -> list[GemmShape]:
    """The step's GEMMs with the linear layers that read one input fused into one GEMM each (what reusing
    their input strips across their GEMMs amounts to): forwards Y = X·[W1; W2; ...]ᵀ, dX = [dY1 dY2 ...]·[W1; W2;
    ...], dW = [dY1 dY2 ...]ᵀ·X. OPT and GPT-2 fuse Q, K and V already (`c_attn`): nothing changes there."""
    out, done = [], set()
    for s in shapes:
        group = next((g for g in SHARED_INPUT if any(f".{p}." in s.name for p in g)), None)
        if group is None:
            out.append(s)
            continue
        prefix, kind = s.name.split(".")[0], s.name.rsplit(".", 1)[1]
        if (prefix, group, kind) in done:
            continue
        done.add((prefix, group, kind))
        parts = [t for t in shapes if t.name.rsplit(".", 1)[1] == kind and t.name.split(".")[1] in group]
        total = sum(t.n if kind == "fwd" else t.k if kind == "dx" else t.m for t in parts)
        name = f"{prefix}.{'_'.join(p.split('_')[0] for p in group)}_proj.{kind}"
        m, n, k = {"fwd": (s.m, total, s.k), "dx": (s.m, s.n, total), "dw": (total, s.n, s.k)}[kind]
        out.append(GemmShape(name, m, n, k, s.count_per_step))
    return out


def fused(cfg: SimConfig, work: Workload, world: World) -> Simulation:
    """The default simulation of the step with `fused_shapes`."""
    return lever_simulation(cfg, replace(work, shapes=tuple(fused_shapes(work.shapes))), world, Lever("", ""))


def policy(cfg: SimConfig, lever: Lever) -> Policy:
    """The PS's dealing knobs under `lever` (no speculative copies: `speculate_factor` 0)."""
    return Policy(window=cfg.window, speculate_factor=Policy.speculate_factor if lever.copies else 0.0)


def lever_simulation(cfg: SimConfig, work: Workload, world: World, lever: Lever) -> Simulation:
    """The simulation `lever` runs (`systems.simulation`'s, with the lever's knobs)."""
    if lever.build is not None:
        return lever.build(cfg, work, world)
    return Simulation(
        world, work.shapes, lever.dtype_bytes or work.dtype_bytes, "cost", lever.tile or cfg.tile,
        cfg.ps_bandwidth, policy(cfg, lever), replan_every_s=cfg.replan_every_s,
        chunks=lever.chunks or cfg.chunks, cache_bytes=lever.cache_bytes or DEFAULT_CACHE_BYTES,
        fan_out=cfg.fan_out if lever.fan_out is None else lever.fan_out, deferred=cfg.deferred if lever.deferred is None else lever.deferred,
    )


def run_lever(cfg: SimConfig, lever: Lever) -> dict[str, Any]:
    """One step of the job under `lever` on a fresh world of `cfg`: its breakdown, the PS's own work added."""
    t0 = time.perf_counter()
    work = Workload.of(cfg.model, cfg.batch, cfg.seq, cfg.dtype)
    sim = lever_simulation(cfg, work, build_world(cfg), lever)
    acc = step_breakdown(sim)
    ps_s = ps_flops(work)["total"] / cfg.ps_flops
    return {
        "lever": lever.name, "what": lever.what, "ps_bandwidth": cfg.ps_bandwidth,
        "cache_bytes": sim.cache_bytes, "chunks": sim.chunks, "tile": sim.tile, "dtype_bytes": sim.dtype_bytes, "fan_out": sim.fan_out,
        "deferred": sim.deferred,
        "gemm_step_s": acc["step_s"], "ps_compute_s": ps_s, "step_s": acc["step_s"] + ps_s,
        "breakdown": acc, "sim_wall_s": time.perf_counter() - t0,
    }


def run_levers(cfg: SimConfig, levers: Sequence[Lever] = LEVERS,
               links: Sequence[float | None] = (None,)) -> list[dict[str, Any]]:
    """Every lever at every PS link (bytes/s, None: unlimited), each on the same world of `cfg`."""
    return [run_lever(replace(cfg, ps_bandwidth=bw), lv) for bw in links for lv in levers]
