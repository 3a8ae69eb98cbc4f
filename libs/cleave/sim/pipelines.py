"""Pipeline baselines: DTFM-style pipeline + data parallelism, Asteroid-style hybrid pipelines, and a pure
pipeline with one stage per device (cost models; see `cleave.sim.baselines` for the shared conventions).

A pipeline cuts the model's units (embedding, layers, head) into S contiguous stages, balanced by FLOPs
or by parameters (whichever fits and runs faster). Micro-batches carry `MICRO_BATCH` samples; a step runs
(micro-batches per pipeline + S - 1) x the slowest stage's micro-batch time (1F1B), then all-reduces each
stage's gradients over the devices that replicate it. A stage's micro-batch time overlaps compute
(forward + backward = 3x forward) with its activation and gradient transfers to the neighbouring stages.
1F1B memory on a device of stage s: the stage's weights x STATE_FACTOR, plus min(S - s, micro-batches)
micro-batches of stashed inputs, plus one layer's working set.

- `dtfm`: D pipelines of S single-device stages (D = N // S, at most one per micro-batch); devices ranked
  by their links and dealt stage by stage, so a stage's data-parallel group is similar devices. DTFM
  searches this assignment with a genetic algorithm and orders stages by a travelling-salesman heuristic;
  we use this fixed heuristic instead (it gives the DTFM-style model its best links, not its worst).
- `asteroid`: at most 8 stages; each stage's devices split every micro-batch's samples between them
  (intra-stage data parallelism, so at most MICRO_BATCH devices a stage); the best S of 1..8, with the
  fastest devices dealt round-robin to the stages. (Asteroid's own planner is a dynamic programme over
  layers, devices and stages; on the uniform edge fleet, balanced stages with equal device counts are what
  it converges to.)
- `pipeline`: S = min(N, units) stages, one device each.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from cleave.sim.baselines import REPLAY_FRACTION, Config, SystemResult, by_uplink, pick
from cleave.sim.workload import MICRO_BATCH, STATE_FACTOR, Ring, Workload, balanced_partitions, ring_bytes

ASTEROID_MAX_STAGES = 8


def _stages(w: Workload, max_parts: int) -> list[list[int]]:
    """Candidate cut points for every S up to max_parts, balanced by FLOPs and by parameters."""
    flops = balanced_partitions([u.fwd_flops for u in w.units], max_parts)
    params = balanced_partitions([u.params for u in w.units], max_parts)
    out: list[list[int]] = []
    for s in flops:
        out += [cuts for cuts in (flops[s], params[s]) if cuts not in out]
    return out


def _evaluate(
    w: Workload,
    cuts: list[int],
    groups: list[np.ndarray],
    links: Ring,
    share: float,
    rounds: int,
    recovery: Callable[[float, float, int], float],
    note: str,
) -> Config:
    """Step time, traffic, memory and recovery of one pipeline layout: stage s runs units cuts[s]:cuts[s+1]
    on devices `groups[s]` (indices into `links`), each taking `share` samples of `rounds` micro-batches."""
    units, b, h, S = w.units, w.dtype_bytes, w.cfg.n_embd, len(groups)
    act = share * w.seq * h * b  # one boundary's activations (or their gradients) for a device's share
    slowest, sent, memory, worst = 0.0, [], 0.0, 0.0
    allreduce = 0.0
    for s, g in enumerate(groups):
        mine = units[cuts[s] : cuts[s + 1]]
        params = sum(u.params for u in mine)
        dev = links.take(g)
        n_out = (s < S - 1) + (s > 0)  # activations forward, gradients backward
        compute = 3 * share * sum(u.fwd_flops for u in mine) / dev.flops
        comm = dev.lat + np.maximum(n_out * act / dev.up, n_out * act / dev.down)
        slowest = max(slowest, float(np.maximum(compute, comm).max()))
        allreduce = max(allreduce, dev.allreduce_s(params * b, len(g)))
        sent += [rounds * n_out * act + 2 * ring_bytes(params * b, len(g))] * len(g)
        stash = min(S - s, rounds) * share * sum(u.stash_bytes for u in mine)
        memory = max(memory, STATE_FACTOR * b * params + stash + share * max(u.work_bytes for u in mine))
        worst = max(worst, STATE_FACTOR * b * params)
    step = (rounds + S - 1) * slowest + allreduce
    return Config(
        step,
        float(np.mean(sent)),
        memory,
        recovery(worst, step, min(len(g) for g in groups)),
        sum(len(g) for g in groups),
        note,
    )


def _reload(links: Ring, from_peer: bool) -> Callable[[float, float, int], float]:
    """Recovery: reload the largest stage's state onto a replacement (from a replica over a peer link,
    or from the checkpoint over its downlink), then replay the lost part of the step."""
    rate = float(np.median(np.minimum(links.up, links.down) if from_peer else links.down))
    return lambda state, step, _group: state / rate + REPLAY_FRACTION * step


def dtfm(w: Workload, declared: Ring, actual: Ring, budget: float) -> SystemResult:
    n, n_mb = len(declared), max(1, w.batch // MICRO_BATCH)
    order = by_uplink(declared)
    configs = []
    for cuts in _stages(w, min(n, len(w.units))):
        S = len(cuts) - 1
        D = max(1, min(n // S, n_mb))
        groups = [order[s * D : (s + 1) * D] for s in range(S)]
        configs.append(
            _evaluate(
                w,
                cuts,
                groups,
                actual,
                MICRO_BATCH,
                math.ceil(n_mb / D),
                _reload(actual, D > 1),
                f"{S} stages x {D} pipelines",
            )
        )
    return pick("dtfm", configs, budget)


def asteroid(w: Workload, declared: Ring, actual: Ring, budget: float) -> SystemResult:
    n, n_mb = len(declared), max(1, w.batch // MICRO_BATCH)
    order = np.argsort(-declared.flops, kind="stable")
    configs = []
    for cuts in _stages(w, min(ASTEROID_MAX_STAGES, n, len(w.units))):
        S = len(cuts) - 1
        per = min(MICRO_BATCH, n // S)
        groups = [order[s::S][:per] for s in range(S)]
        reload = _reload(actual, False)

        def recovery(state: float, step: float, group: int, reload=reload) -> float:
            # survivors of a stage hold its weights; they replay the lost device's share of the step
            return REPLAY_FRACTION * step / group if group > 1 else reload(state, step, group)

        configs.append(
            _evaluate(
                w, cuts, groups, actual, MICRO_BATCH / per, n_mb, recovery, f"{S} stages x {per} devices"
            )
        )
    return pick("asteroid", configs, budget)


def pipeline(w: Workload, declared: Ring, actual: Ring, budget: float) -> SystemResult:
    n_mb = max(1, w.batch // MICRO_BATCH)
    order = by_uplink(declared)
    S = min(len(declared), len(w.units))
    configs = [
        _evaluate(
            w,
            cuts,
            [order[s : s + 1] for s in range(S)],
            actual,
            MICRO_BATCH,
            n_mb,
            _reload(actual, False),
            f"{S} stages",
        )
        for cuts in _stages(w, S)
        if len(cuts) - 1 == S
    ]
    return pick("pipeline", configs, budget)
