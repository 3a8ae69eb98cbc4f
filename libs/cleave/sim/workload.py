"""A training job as the cost models see it: the model's GEMMs, parameters, activations and the memory and
collective-communication formulas the baselines share (pure arithmetic).

Conventions, shared by every system so that they compare like with like:
- Only the linear layers' GEMMs count as device work (attention products, norms and the loss are left
  out of the baselines, for whom they are a few per cent of the FLOPs spread over the devices; Cleave's
  PS does them itself and is charged for them, `cleave.sim.ps`).
- A device holding weights holds `STATE_FACTOR` x their bytes: the weights and twice as much optimizer
  state, the published baselines' memory model.
- Activations are checkpointed (generous to the baselines): a layer keeps only its input for the
  backward pass (`seq x hidden` elements a sample), and the layer being recomputed needs a working set of
  `WORK_FACTOR x seq x hidden` bytes a sample in 16-bit (Korthikanti et al. 2022, without the attention
  matrix, as with a memory-efficient attention kernel).
- Peer links: data from device i to device j moves at min(uplink_i, downlink_j); a collective over a ring
  runs at its slowest hop, and each hop costs both devices' latencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from cleave.models import GemmShape, ModelConfig, StepLayout, gemm_shapes, get_preset
from cleave.plan.planner import DTYPE_BYTES

STATE_FACTOR = 3.0  # weights + 2x weights of optimizer state
WORK_FACTOR = 34.0  # bytes per token x hidden of a 16-bit layer's working set during its backward
MICRO_BATCH = 4  # samples per micro-batch (the published pipeline model: micro-batches = batch / 4)


@dataclass(frozen=True)
class Unit:
    """A pipeline unit (the embedding, one transformer layer, or the output head)."""

    name: str
    params: float
    fwd_flops: float  # per sample
    stash_bytes: float  # kept per sample while its micro-batch is in flight (its input)
    work_bytes: float  # per sample, while it runs its backward


@dataclass(frozen=True)
class Workload:
    """One training step of a model: `batch` sequences of `seq` tokens, elements of `dtype_bytes`."""

    model: str
    cfg: ModelConfig
    batch: int
    seq: int
    dtype_bytes: int
    shapes: tuple[GemmShape, ...]  # what Cleave's PS deals in a step (`of`: the job's layout)

    @classmethod
    def of(cls, model: str, batch: int, seq: int, dtype: str = "fp16") -> Workload:
        """The job as Cleave's PS runs it (`StepLayout.of`: the head and loss in chunks of tokens, the head's input
        gradient over slices of the vocabulary); the baselines see the same model in one pass (`one_pass`)."""
        cfg = get_preset(model)
        layout = StepLayout.of(cfg, batch * seq)
        return cls(model, cfg, batch, seq, DTYPE_BYTES[dtype], tuple(gemm_shapes(cfg, batch, seq, layout)))

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @cached_property
    def one_pass(self) -> list[GemmShape]:
        """The step's GEMMs in one pass over the batch, each linear layer's three products once (the baselines'
        step: `shapes` cuts the head into the pieces Cleave's PS deals)."""
        return gemm_shapes(self.cfg, self.batch, self.seq)

    @cached_property
    def layer_gemms(self) -> list[tuple[int, int]]:
        """(k, n) of each linear layer of one transformer block (forward Y[M, n] = X[M, k] · W)."""
        return [
            (s.k, s.n)
            for s in self.one_pass
            if s.name.endswith(".fwd") and s.count_per_step == self.cfg.n_layer
        ]

    @cached_property
    def head_gemms(self) -> list[tuple[int, int]]:
        return [
            (s.k, s.n)
            for s in self.one_pass
            if s.name.endswith(".fwd") and s.count_per_step != self.cfg.n_layer
        ]

    @cached_property
    def fwd_gemms(self) -> list[tuple[int, int, int]]:
        """(k, n, count per step) of every forward GEMM kind."""
        return [(s.k, s.n, s.count_per_step) for s in self.one_pass if s.name.endswith(".fwd")]

    def grid_tiles(self, rows: int, cols: int) -> int:
        """The tiles of a step's GEMMs each cut on a grid of at most `rows` x `cols` (the fewest a tile limit
        leaves: planned blocks cut to it give at least as many)."""
        return sum(-(-s.m // rows) * -(-s.n // cols) * s.count_per_step for s in self.shapes)

    @property
    def step_flops(self) -> float:
        """Every GEMM of a step (forward and both backward products)."""
        return float(sum(s.flops * s.count_per_step for s in self.shapes))

    @cached_property
    def units(self) -> list[Unit]:
        c, s, b = self.cfg, self.seq, self.dtype_bytes
        h = c.n_embd
        work = WORK_FACTOR * s * h * b / 2
        embed = Unit(
            "embed",
            float(c.vocab_size * h + (c.block_size * h if c.family == "gpt2" else 0)),
            0.0,
            0.0,
            float(s * h * b),
        )
        layer_params = float(sum(k * n for k, n in self.layer_gemms))
        layer = Unit("layer", layer_params, 2.0 * s * layer_params, float(s * h * b), work)
        head_params = float(sum(k * n for k, n in self.head_gemms))
        head = Unit("head", head_params, 2.0 * s * head_params, float(s * h * b), 2.0 * s * c.vocab_size * b)
        return [embed, *([layer] * c.n_layer), head]

    @property
    def params(self) -> float:
        """Parameters the devices must hold between them (a tied head counts once)."""
        head = 0.0 if self.cfg.tie_embeddings else self.units[-1].params
        return sum(u.params for u in self.units[:-1]) + head

    @property
    def layer_input_bytes(self) -> float:
        """One layer's input for the whole batch (what checkpointing keeps per layer)."""
        return float(self.tokens * self.cfg.n_embd * self.dtype_bytes)


@dataclass(frozen=True)
class Ring:
    """The devices a system uses (their actual profiles), in ring order, and collectives over them."""

    flops: np.ndarray
    up: np.ndarray
    down: np.ndarray
    lat: np.ndarray
    mem: np.ndarray

    def take(self, idx: np.ndarray) -> Ring:
        return Ring(self.flops[idx], self.up[idx], self.down[idx], self.lat[idx], self.mem[idx])

    def __len__(self) -> int:
        return len(self.flops)

    @property
    def ring_bw(self) -> float:
        """Bytes/s of the slowest hop i -> i+1 of the ring: min(uplink_i, downlink_{i+1})."""
        if len(self) < 2:
            return float("inf")
        return float(np.minimum(self.up, np.roll(self.down, -1)).min())

    @property
    def hop_s(self) -> float:
        return 2.0 * float(self.lat.mean())

    def allgather_s(self, total_bytes: float, p: int) -> float:
        """All-gather of `total_bytes` over rings of `p` of these devices."""
        return ring_allgather_s(total_bytes, p, self.ring_bw, self.hop_s)

    def allreduce_s(self, nbytes: float, p: int) -> float:
        """All-reduce of `nbytes` (each device's buffer) over rings of `p` devices."""
        return ring_allreduce_s(nbytes, p, self.ring_bw, self.hop_s)


def ring_allgather_s(total_bytes: float, p: int, bandwidth: float, hop_s: float) -> float:
    """Seconds of a ring all-gather of `total_bytes` among `p` members whose slowest hop moves `bandwidth`
    bytes/s and costs `hop_s`: p - 1 rounds, each member sending 1/p of the data a round."""
    if p <= 1:
        return 0.0
    return (p - 1) / p * total_bytes / bandwidth + (p - 1) * hop_s


def ring_allreduce_s(nbytes: float, p: int, bandwidth: float, hop_s: float) -> float:
    """A ring all-reduce of each member's `nbytes`: a reduce-scatter and an all-gather."""
    return 2.0 * ring_allgather_s(nbytes, p, bandwidth, hop_s)


def ring_bytes(nbytes: float, p: int) -> float:
    """Bytes each device sends (and receives) in a ring all-gather of `nbytes` in total."""
    return (p - 1) / p * nbytes if p > 1 else 0.0


def balanced_partitions(weights: list[float], max_parts: int) -> dict[int, list[int]]:
    """For every number of parts up to `max_parts`: cut points 0 = c_0 < ... < c_parts = len(weights) of
    contiguous parts minimising the largest part's sum (the linear-partition dynamic programme)."""
    n = len(weights)
    top = min(max_parts, n)
    pre = np.concatenate([[0.0], np.cumsum(weights)])
    best = np.full((top + 1, n + 1), np.inf)
    cut = np.zeros((top + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for p in range(1, top + 1):
        for j in range(p, n + 1):
            i = np.arange(p - 1, j)
            cost = np.maximum(best[p - 1, i], pre[j] - pre[i])
            a = int(np.argmin(cost))
            best[p, j], cut[p, j] = cost[a], i[a]
    out = {}
    for parts in range(1, top + 1):
        cuts, j = [n], n
        for p in range(parts, 0, -1):
            j = int(cut[p, j])
            cuts.append(j)
        out[parts] = cuts[::-1]
    return out
