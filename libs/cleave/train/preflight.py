"""Preflight: will a job fit? The PS's peak memory and each worker's largest tile, estimated before it starts.

The PS holds the fp32 weights, their gradients and AdamW's two moments (4 copies of the parameters), the
activations autograd saves for the backward at batch x seq (counted exactly by running the model's forward
on the meta device, which allocates nothing), the largest GEMM's inputs and output as they travel (the bus
buffers) and those of the weight-gradient GEMMs deferred beside it (`deferred_gemms`: copies of dYᵀ and Xᵀ
and the product, for the largest such GEMMs), the streamed checkpoint's few in-flight chunks, and the Python/torch runtime. A job whose
estimate exceeds the memory the PS may use is refused at once, with the numbers and the knob to turn,
instead of being killed by the OOM killer later. `cleave train --dry-run` prints the estimate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cleave.errors import ConfigError
from cleave.gemm.ledger import DEFAULT_DEFERRED
from cleave.gemm.tiles import MIN_BLOCK
from cleave.models import GemmShape, build_model, gemm_shapes
from cleave.plan.costmodel import tile_memory_bytes
from cleave.plan.planner import _even_blocks  # the even split the planner falls back to
from cleave.train.job import JobConfig

RUNTIME_BYTES = 256 * 1024 * 1024  # Python, torch, nats-py and cleave imported (248 MB measured, /usr/bin/time)
CHECKPOINT_BUFFER_BYTES = 3 * 16 * 1024 * 1024  # a hash chunk and the Object Store's chunks in flight
DEFAULT_WORKER_MEMORY = 512 * 1024 * 1024  # the worker's default memory_bytes
GB = 1e9


@dataclass(frozen=True)
class Estimate:
    params: int
    weights: int  # bytes
    grads: int
    optimizer: int
    activations: int
    bus: int
    checkpoint: int
    runtime: int
    largest_tile: tuple[str, int, int, int, int]  # GEMM kind, rows, cols, K, bytes (an even split)
    smallest_tile: int  # bytes of the thinnest tile the dealer cuts (MIN_BLOCK x MIN_BLOCK) of the largest K

    @property
    def total(self) -> int:
        return (self.weights + self.grads + self.optimizer + self.activations + self.bus + self.checkpoint
                + self.runtime)

    def lines(self) -> list[str]:
        name, rows, cols, k, tile = self.largest_tile
        return [
            f"parameters   {self.params / 1e6:10.1f} M",
            f"weights      {self.weights / GB:10.2f} GB  (fp32)",
            f"gradients    {self.grads / GB:10.2f} GB",
            f"optimizer    {self.optimizer / GB:10.2f} GB  (AdamW: two moments)",
            f"activations  {self.activations / GB:10.2f} GB  (saved for the backward at batch x seq)",
            f"bus buffers  {self.bus / GB:10.2f} GB  (the largest GEMM's inputs and output, and deferred dW's)",
            f"checkpoint   {self.checkpoint / GB:10.2f} GB  (streamed: chunks in flight)",
            f"runtime      {self.runtime / GB:10.2f} GB  (Python, torch)",
            f"PS peak      {self.total / GB:10.2f} GB",
            f"worker tile  {tile / GB:10.3f} GB  ({name}: {rows} x {cols}, K={k}, split evenly)",
        ]


def activation_bytes(job: JobConfig) -> int:
    """Bytes autograd saves in one forward and loss at the job's batch and seq (meta device: nothing runs)."""
    model = build_model(job.arch(), device="meta")
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}
    keep = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) not in own and id(base) not in own:
            saved[id(t)] = t.numel() * t.element_size()
            keep.append(t)  # ids stay unique while the graph lives
        return t

    x = torch.zeros(job.batch_size, job.seq, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x)  # (B, T, vocab)
        F.cross_entropy(logits.view(-1, logits.size(-1)), x.view(-1))
    return sum(saved.values()) + logits.numel() * logits.element_size()


def estimate(job: JobConfig, workers: int, tile_bytes: int = 4, deferred: int = DEFAULT_DEFERRED) -> Estimate:
    cfg = job.arch()
    meta = build_model(cfg, device="meta")
    params = sum(p.numel() for p in meta.parameters())
    shapes = gemm_shapes(cfg, job.batch_size, job.seq)

    def buffers(g: GemmShape) -> int:
        return (g.m * g.k + g.k * g.n) * tile_bytes + g.m * g.n * 4

    dws = sorted((buffers(g) for g in shapes if g.name.endswith(".dw") for _ in range(g.count_per_step)), reverse=True)
    bus = max(buffers(g) for g in shapes) + sum(dws[:deferred])
    largest = max((_largest_block(g, workers, tile_bytes) for g in shapes), key=lambda t: t[-1])
    kmax = max(g.k for g in shapes)
    thin = int(tile_memory_bytes(np.array([MIN_BLOCK]), np.array([MIN_BLOCK]), kmax, tile_bytes)[0])
    return Estimate(params=params, weights=4 * params, grads=4 * params, optimizer=8 * params,
                    activations=activation_bytes(job), bus=bus, checkpoint=CHECKPOINT_BUFFER_BYTES,
                    runtime=RUNTIME_BYTES, largest_tile=largest, smallest_tile=thin)


def _largest_block(g: GemmShape, workers: int, b: int) -> tuple[str, int, int, int, int]:
    """The largest block of the planner's even split of GEMM `g` over `workers`, and its bytes."""
    r0, r1, c0, c1 = _even_blocks(g.m, g.n, max(1, workers))
    mem = tile_memory_bytes(r1 - r0, c1 - c0, g.k, b)
    i = int(np.argmax(mem))
    return g.name, int(r1[i] - r0[i]), int(c1[i] - c0[i]), g.k, int(mem[i])


def available_memory() -> int:
    """What this process may still use: the cgroup's limit when set, else the kernel's MemAvailable."""
    limit = None
    cg = Path("/sys/fs/cgroup/memory.max")
    if cg.is_file() and cg.read_text().strip() not in ("", "max"):
        limit = int(cg.read_text()) - int(Path("/sys/fs/cgroup/memory.current").read_text() or 0)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                return avail if limit is None else min(avail, limit)
    except OSError:
        pass
    return limit if limit is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _knobs(job: JobConfig, est: Estimate, memory: int) -> list[str]:
    """What to change, the knob that frees most first."""
    knobs = []
    per_token = est.activations + est.bus
    if per_token >= est.total - memory or per_token > 0.25 * est.total:
        knobs.append(f"lower batch_size (now {job.batch_size}) or seq_len (now {job.seq}): activations and "
                     f"bus buffers take {per_token / GB:.2f} GB and scale with both")
    if est.weights + est.grads + est.optimizer + est.runtime > memory or not knobs:
        knobs.append("choose a smaller model (preset) or give the PS more memory (a larger machine, or "
                     "CLEAVE_PS_MEMORY_BYTES if the detected amount is wrong)")
    return knobs


def check(job: JobConfig, est: Estimate, ps_memory: int, worker_memory: int = DEFAULT_WORKER_MEMORY) -> None:
    """Refuse a job that cannot fit, with the numbers and the knob to change."""
    if est.total > ps_memory:
        raise ConfigError(
            f"job {job.job_id!r} needs about {est.total / GB:.2f} GB on the PS (weights {est.weights / GB:.2f}, "
            f"gradients {est.grads / GB:.2f}, AdamW {est.optimizer / GB:.2f}, activations "
            f"{est.activations / GB:.2f}, bus {est.bus / GB:.2f}, runtime {est.runtime / GB:.2f}) but "
            f"{ps_memory / GB:.2f} GB are available; to fit, " + "; or ".join(_knobs(job, est, ps_memory)))
    if est.smallest_tile > worker_memory:
        raise ConfigError(
            f"the thinnest tile of job {job.job_id!r} needs {est.smallest_tile / GB:.3f} GB on a worker, over "
            f"its memory_bytes {worker_memory / GB:.3f} GB; give workers more memory (CLEAVE_WORKER_MEMORY_BYTES) "
            f"or use a smaller model (preset)")
