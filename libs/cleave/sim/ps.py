"""The PS's own bill for one training step (pure arithmetic): the work it does itself (attention products,
norms, softmax and loss, the optimizer), the memory it holds (weights, optimizer state, saved activations),
and, when one PS is not enough, how many data-parallel replicas the job needs and what their gradient
all-reduce costs on the PS-to-PS link.

Conventions (each a constant below, with where it comes from):
- Attention products are counted whole, as the math kernel computes them: per layer and sample,
  Q·Kᵀ and P·V are 2·T²·C FLOPs each forward, and the backward does twice the forward (dQ, dK, dP, dV).
  A causal flash kernel skips up to half of them; the count is an upper bound by that factor.
- Element-wise work (norms, activations, residual adds, softmax, the loss) is a few FLOPs per element
  forward and `BACKWARD_FACTOR` times that backward; AdamW is `ADAM_FLOPS_PER_PARAM` per parameter.
- State: `STATE_BYTES_PER_PARAM` bytes a parameter (mixed-precision Adam: 16-bit weights and gradients,
  32-bit master weights, momentum and variance; ZeRO, Rajbhandari et al. 2020); every replica holds it all.
- Saved activations: a layer keeps `SAVED_PER_TOKEN_HIDDEN` elements per token and hidden unit for its
  backward (the 34 bytes of 16-bit of Korthikanti et al. 2022 without the attention matrix, which the
  memory-efficient kernel recomputes), plus the float32 logits of one chunk of the head (the PS runs the head
  and the loss in chunks of tokens, `StepLayout.of`); a replica keeps its share of the batch.
- Replicas split the batch (and the fleet) R ways: the inputs that carry tokens (activations, output
  gradients) leave each replica at 1/R, the weights leave every replica whole; the fleet's GEMM time is
  taken as unchanged (each replica's devices do 1/R of the work).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cleave.models import StepLayout
from cleave.sim.workload import WORK_FACTOR, Workload, ring_allreduce_s

DEFAULT_PS_FLOPS = 5e12  # a 64-core cloud VM in torch (~100 GFLOP/s a core, as measured here on 2 cores)
DEFAULT_PS_MEMORY = 512 * 2**30  # that VM's RAM, bytes
DEFAULT_PS_LINK = 1.25e9  # bytes/s between PS replicas: a 10 Gbit/s NIC (their all-reduce runs in gloo/NCCL)
PS_LINK_LATENCY_S = 5e-4  # one hop between replicas in one region
MAX_REPLICAS = 64  # the largest data-parallel group the report considers
REPLICA_SLACK = 1.1  # replicas needed: the fewest whose step is within 10% of the best

STATE_BYTES_PER_PARAM = 16.0
GRAD_BYTES = 4  # gradients all-reduced in fp32 (the PS's own dtype)
SAVED_PER_TOKEN_HIDDEN = WORK_FACTOR / 2  # 17 elements of one layer's input-sized tensors, a token
LOGITS_BYTES = 4  # a logit, as the PS computes the loss (float32)
ADAM_FLOPS_PER_PARAM = 14.0  # moments 7, the update 5, weight decay 2
NORM_FLOPS = 8.0  # per element: mean, variance, normalise, scale and shift
ACT_FLOPS = 10.0  # per element of the MLP's width (GELU's tanh form; SwiGLU about the same)
SOFTMAX_FLOPS = 5.0  # per score (max, subtract, exp, sum, divide); the loss's too, per logit
BACKWARD_FACTOR = 2.0  # the backward of the PS's own operations costs twice their forward


@dataclass(frozen=True)
class PsSpec:
    """One PS machine: its FLOP/s for its own work, its memory, and its link to the other replicas."""

    flops: float = DEFAULT_PS_FLOPS
    memory_bytes: float = DEFAULT_PS_MEMORY
    link: float = DEFAULT_PS_LINK  # bytes/s
    link_latency_s: float = PS_LINK_LATENCY_S


def ps_flops(work: Workload) -> dict[str, float]:
    """FLOPs of the PS's own work in one step (the whole batch), by part; "total" sums them."""
    c = work.cfg
    tokens, h, t, layers = work.tokens, c.n_embd, work.seq, c.n_layer
    attention = 4.0 * tokens * t * h * layers * (1 + BACKWARD_FACTOR)  # Q·Kᵀ and P·V: 2·T·C a token each
    scores = float(tokens * c.n_head * t * layers)
    elementwise = tokens * layers * (2 * NORM_FLOPS * h + ACT_FLOPS * c.mlp_width + 2.0 * h)
    elementwise += tokens * NORM_FLOPS * h  # the final norm
    parts = {
        "attention": attention,
        "softmax": SOFTMAX_FLOPS * scores * (1 + BACKWARD_FACTOR),
        "elementwise": elementwise * (1 + BACKWARD_FACTOR),
        "loss": SOFTMAX_FLOPS * tokens * c.vocab_size * (1 + BACKWARD_FACTOR),
        "optimizer": ADAM_FLOPS_PER_PARAM * work.params,
    }
    parts["total"] = sum(parts.values())
    return parts


def ps_memory(work: Workload, replicas: int = 1) -> dict[str, float]:
    """Bytes one of `replicas` PS replicas holds at the peak of a step (its share of the batch)."""
    c, b = work.cfg, work.dtype_bytes
    tokens = work.tokens / replicas
    state = STATE_BYTES_PER_PARAM * work.params
    saved = tokens * c.n_embd * c.n_layer * SAVED_PER_TOKEN_HIDDEN * b
    logits = LOGITS_BYTES * c.vocab_size * tokens / StepLayout.of(c, max(1, math.ceil(tokens))).head_chunks
    return {"state": state, "activations": saved + logits, "logits": logits, "total": state + saved + logits}


def replicas_by_memory(work: Workload, memory_bytes: float) -> int | None:
    """The fewest replicas whose share of the batch fits in `memory_bytes` each (None: none does, as when the
    state alone does not fit: data-parallel replicas each hold all of it)."""
    m = ps_memory(work)
    room = memory_bytes - m["state"]
    if room <= 0:
        return None
    replicas = max(1, math.ceil(m["activations"] / room))  # (the logits of a smaller share may come in fewer chunks)
    while ps_memory(work, replicas)["total"] > memory_bytes:
        if replicas >= work.tokens:  # (one token a replica, and still too much)
            return None
        replicas += 1
    return replicas


def egress_share(work: Workload, replicas: int) -> float:
    """One replica's distinct input bytes over a single PS's: the token-carrying inputs split, weights not.

    C[m, n] = A[m, k] · B[k, n]: in a forward and a dX product A carries the tokens and B is a weight; in a
    dW product both carry them (k = tokens)."""
    split = whole = 0.0
    for s in work.shapes:
        a, bb = s.m * s.k * work.dtype_bytes * s.count_per_step, s.n * s.k * work.dtype_bytes * s.count_per_step
        if s.name.endswith(".dw"):
            split += a + bb
        else:
            split += a
            whole += bb
    return (split / replicas + whole) / (split + whole)


def allreduce_s(work: Workload, spec: PsSpec, replicas: int) -> float:
    """Seconds of the ring all-reduce of every gradient among `replicas` replicas on the PS-to-PS link."""
    return ring_allreduce_s(GRAD_BYTES * work.params, replicas, spec.link, 2.0 * spec.link_latency_s)


def step_with_replicas(work: Workload, spec: PsSpec, fleet: dict[str, float], replicas: int) -> dict[str, float]:
    """One step's estimate with `replicas` PS replicas, from one PS's simulated step (`fleet`: "gemm_step_s"
    as simulated, "ps_bytes" it sent, "ps_bandwidth" (0: unlimited) and "fleet_s", the scheduler's
    prediction for the fleet alone, without the egress limit). The GEMM part scales with its binding bound
    (the fleet, or the replica's egress) and never drops below "fleet_s"; the PS's own work splits R ways and
    the all-reduce is added (neither overlaps the GEMMs: autograd runs them in between)."""
    bw, fleet_s = fleet["ps_bandwidth"], fleet["fleet_s"]
    egress = fleet["ps_bytes"] * egress_share(work, replicas) / bw if bw else 0.0
    bound_one = max(fleet_s, fleet["ps_bytes"] / bw if bw else 0.0)
    scaled = fleet["gemm_step_s"] * max(fleet_s, egress) / bound_one if bound_one else fleet["gemm_step_s"]
    gemm = max(fleet_s, scaled) if replicas > 1 else fleet["gemm_step_s"]
    compute = ps_flops(work)["total"] / spec.flops / replicas
    reduce = allreduce_s(work, spec, replicas)
    return {"replicas": replicas, "step_s": gemm + compute + reduce, "gemm_s": gemm, "egress_s": egress,
            "compute_s": compute, "allreduce_s": reduce, "memory_bytes": ps_memory(work, replicas)["total"]}


def charge(work: Workload, spec: PsSpec, fleet: dict[str, float]) -> dict[str, Any]:
    """The PS's bill for one step and the replicas the job needs (`fleet` as in `step_with_replicas`):
    "bound" names what limits a single PS's step (its memory, else the longest of its egress, its own
    compute and the fleet's GEMMs: "time_bound"); "replicas" is the fewest that fit in memory and come
    within `REPLICA_SLACK` of the best step up to `MAX_REPLICAS` (None: none fits)."""
    flops = ps_flops(work)
    one = step_with_replicas(work, spec, fleet, 1)
    by_memory = replicas_by_memory(work, spec.memory_bytes)
    rows = {r: step_with_replicas(work, spec, fleet, r) for r in range(1, MAX_REPLICAS + 1)}
    need = None
    if by_memory is not None and by_memory <= MAX_REPLICAS:
        best = min(rows[r]["step_s"] for r in range(by_memory, MAX_REPLICAS + 1))
        need = next(r for r in range(by_memory, MAX_REPLICAS + 1) if rows[r]["step_s"] <= REPLICA_SLACK * best)
    times = {"fleet": fleet["fleet_s"], "ps_egress": one["egress_s"], "ps_compute": one["compute_s"]}
    slowest = max(times, key=lambda k: times[k])
    bound = "ps_memory" if by_memory != 1 else slowest
    return {
        "flops": flops,
        "compute_s": one["compute_s"],
        "memory_bytes": ps_memory(work),
        "fits_one_ps": by_memory == 1,
        "egress_s": one["egress_s"],
        "fleet_s": fleet["fleet_s"],
        "bound": bound,
        "time_bound": slowest,  # the longest of the fleet's GEMMs, the PS's egress and its own work
        "step_s": fleet["gemm_step_s"] + one["compute_s"],
        "replicas_by_memory": by_memory,
        "replicas": need,
        "with_replicas": rows[need] if need else None,
        "by_replicas": [rows[r] for r in (1, 2, 4, 8, 16, 32, 64)],
        "spec": {"flops": spec.flops, "memory_bytes": spec.memory_bytes, "link": spec.link},
    }
