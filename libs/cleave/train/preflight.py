"""Preflight: will a job fit? The PS's peak memory and each worker's largest tile, estimated before it starts.

The PS holds the fp32 weights and AdamW's two moments throughout (allocated before the first step,
`Trainer.hold_optimizer_state`; its fused step allocates nothing more),
and at the peak of a step one of:
- the end of a micro-batch's forward: the activations autograd saves for its backward (counted by running
  the PS's own model, linear layers and precision on fake tensors, which allocate nothing: with
  `recompute`, each block's input and one block's saved tensors, as its recomputation holds them), the
  head's chunk of logits and its weight gradient (`cleave.gemm.head`), the gradients of the micro-batches
  before it, and the largest GEMM's inputs and output as they travel (the bus buffers);
- the start of the backward: those activations, the head's weight gradient (or every gradient, after the
  first micro-batch) and the bus buffers with those of the weight-gradient GEMMs deferred beside the backward
  (`deferred_gemms`: only a backward defers them);
- the end of the backward: every gradient (the embedding's added in place: `cleave.models.embed`) and the
  bus buffers (in between, activations fall and gradients grow block by block, so one of the two ends holds
  the most);
plus the streamed checkpoint's few in-flight chunks, the freed GEMM outputs the PS keeps to reuse (at most
`product_pool_bytes`, where its outputs are large enough, and only in memory the job leaves:
`cleave_ps.fleet.products`) and the Python/torch runtime. A job whose estimate exceeds the memory the PS may use
is refused at once, with the numbers and the knob to turn, instead of being killed by the OOM killer later;
`recompute` left undecided (None) is turned on when, and only when, the job does not fit without it, and then
the PS defers fewer weight gradients (`deferred_gemms` is its most) when, and only as far as, the job does not
fit with all of them (`resolve`). Where the PS trains on a GPU, the model's part is checked against the GPU's
free memory (`torch.cuda.mem_get_info`) and the rest against the host's. `cleave train --dry-run` prints the
estimate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cleave.errors import ConfigError
from cleave.gemm import tiled
from cleave.gemm.ledger import DEFAULT_DEFERRED
from cleave.gemm.tiles import MIN_BLOCK
from cleave.models import GemmShape, StepLayout, build_model, gemm_shapes
from cleave.models.gemms import HEAD
from cleave.plan.costmodel import tile_memory_bytes
from cleave.plan.planner import _even_blocks  # the even split the planner falls back to
from cleave.runtime.memory import MAPPED_BYTES
from cleave.train import precision
from cleave.train.job import JobConfig
from cleave.train.trainer import resolve_device

RUNTIME_BYTES = 256 * 1024 * 1024  # Python, torch, nats-py and cleave imported (248 MB measured, /usr/bin/time)
CHECKPOINT_BUFFER_BYTES = 3 * 16 * 1024 * 1024  # a hash chunk and the Object Store's chunks in flight
DEFAULT_WORKER_MEMORY = 512 * 1024 * 1024  # the worker's default memory_bytes
GB = 1e9


@dataclass(frozen=True)
class Activations:
    """What one micro-batch's forward keeps for its backward, in bytes."""

    outside: int  # outside the blocks (embedding, final norm)
    block: int  # by one block
    block_input: int  # one block's input (what a recomputed block keeps)
    n_layer: int

    def saved(self, recompute: bool) -> int:
        if recompute:
            return self.outside + self.n_layer * self.block_input + self.block
        return self.outside + self.n_layer * self.block


@dataclass(frozen=True)
class Estimate:
    params: int
    weights: int  # bytes
    grads: int
    optimizer: int
    activations: int  # saved by one micro-batch's forward
    head: int  # the head and loss of one chunk at their peak: the sum of dW and the largest phase (`head_bytes`)
    bus: int
    deferred: tuple[int, int]  # the PS's deferred_gemms, and the bytes of the bus buffers their GEMMs hold
    checkpoint: int
    runtime: int
    layout: StepLayout
    largest_tile: tuple[str, int, int, int, int]  # GEMM kind, rows, cols, K, bytes (an even split)
    smallest_tile: int  # bytes of the thinnest tile the dealer cuts (MIN_BLOCK x MIN_BLOCK) of the largest K
    dw_buffers: tuple[int, ...] = ()  # the bus buffers of each weight gradient that may be deferred, largest first
    pool: int = 0  # freed GEMM outputs kept to reuse, at most
    head_grad: int = 0  # the head's weight gradient (its running sum over the chunks), float32

    def deferring(self, count: int) -> Estimate:
        """The same job with `count` weight gradients deferred beside the backward (the largest ones)."""
        held = sum(self.dw_buffers[:count])
        return replace(self, bus=self.bus - self.deferred[1] + held, deferred=(count, held))

    @property
    def phases(self) -> dict[str, tuple[int, int]]:
        """What a step holds besides the weights, AdamW, the checkpoint's chunks and the runtime, at each of
        its peaks: (on the PS's device, in host memory)."""
        before = self.grads if self.layout.micro_batches > 1 else 0  # earlier micro-batches' gradients
        # weight gradients are deferred only within a backward (LateGrads): a forward has its largest GEMM's
        # buffers alone; a backward starts with every activation and the head's gradient (or all of them,
        # held since the first micro-batch) and ends with every gradient, activations falling and gradients
        # growing block by block in between
        return {"the end of a forward": (before + self.activations + self.head, self.bus - self.deferred[1]),
                "the start of the backward": ((before or self.head_grad) + self.activations, self.bus),
                "the end of the backward": (self.grads, self.bus)}

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p]))

    @property
    def model_bytes(self) -> int:
        """At most on the PS's device (a GPU's memory when it trains there)."""
        return self.weights + self.optimizer + max(d for d, _ in self.phases.values())

    @property
    def host_bytes(self) -> int:
        """At most in host memory whatever the device: the bus buffers, checkpoint chunks, pool, runtime."""
        return self.checkpoint + self.pool + self.runtime + max(h for _, h in self.phases.values())

    @property
    def total(self) -> int:
        """The peak of a PS that trains on the CPU."""
        return (self.weights + self.optimizer + self.checkpoint + self.pool + self.runtime
                + sum(self.phases[self.peak_phase]))

    def lines(self) -> list[str]:
        name, rows, cols, k, tile = self.largest_tile
        lay = self.layout
        how = (f"{lay.micro_batches} micro-batches, " if lay.micro_batches > 1 else "") + (
            "recomputed: each block's input and one block" if lay.recompute else "every block")
        return [
            f"parameters   {self.params / 1e6:10.1f} M",
            f"weights      {self.weights / GB:10.2f} GB  (fp32)",
            f"gradients    {self.grads / GB:10.2f} GB",
            f"optimizer    {self.optimizer / GB:10.2f} GB  (AdamW: two moments)",
            f"activations  {self.activations / GB:10.2f} GB  (saved for the backward: {how})",
            f"head         {self.head / GB:10.2f} GB  (the head and loss in {lay.head_chunks} chunk(s) of tokens: "
            f"logits, their gradient, dW and its running sum)",
            f"bus buffers  {self.bus / GB:10.2f} GB  (the largest GEMM's inputs and output, and "
            f"{self.deferred[0]} deferred dW's)",
            f"checkpoint   {self.checkpoint / GB:10.2f} GB  (streamed: chunks in flight)",
            f"free outputs {self.pool / GB:10.2f} GB  (freed GEMM outputs kept to reuse, in the room left: product_pool_bytes)",
            f"runtime      {self.runtime / GB:10.2f} GB  (Python, torch)",
            f"PS peak      {self.total / GB:10.2f} GB  (at {self.peak_phase})",
            f"worker tile  {tile / GB:10.3f} GB  ({name}: {rows} x {cols}, K={k}, split evenly)",
        ]


class _NoProducts:
    """A GEMM backend on fake tensors: the product's shape and dtype, nothing computed."""

    def gemm(self, a: torch.Tensor, bt: torch.Tensor, name: str) -> torch.Tensor:
        return a.new_empty(a.shape[0], bt.shape[0])


def activations(job: JobConfig, layout: StepLayout, replicas: int = 1) -> Activations:
    """Bytes autograd saves in one micro-batch's forward on the PS: its model with its linear layers and
    precision, on fake tensors (nothing allocated, nothing computed; the CPU's kernels choose what to save,
    as a GPU's fused attention does)."""
    cfg = job.arch()
    batch = job.batch_size // replicas // layout.micro_batches
    with FakeTensorMode():
        model = build_model(cfg)
        tiled.install(model, _NoProducts(), precision.dtype_of(job.precision))
        own = {id(t) for t in (*model.parameters(), *model.buffers())}
        blocks = list(getattr(model, "layers", None) or model.transformer.h)
        where, saved, inputs, keep = [None], {}, {}, []

        def enter(i: int):  # noqa: ANN202
            def hook(_mod, args) -> None:  # noqa: ANN001
                where[0] = i
                inputs[i] = args[0].numel() * args[0].element_size()
            return hook

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = t._base if t._base is not None else t
            if id(t) not in own and id(base) not in own and id(base) not in saved:
                saved[id(base)] = (where[0], base.numel() * base.element_size())
                keep.append(base)  # ids stay unique while the graph lives
            return t

        handles = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(blocks)]
        handles += [b.register_forward_hook(lambda *_: where.__setitem__(0, None)) for b in blocks]
        x = torch.zeros(batch, job.seq, dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                precision.autocast(job.precision, torch.device("cpu")):
            model.hidden(x)
        for h in handles:
            h.remove()
    per = {i: sum(b for w, b in saved.values() if w == i) for i in range(len(blocks))}
    return Activations(outside=sum(b for w, b in saved.values() if w is None), block=max(per.values()),
                       block_input=max(inputs.values()), n_layer=len(blocks))


def activation_bytes(job: JobConfig) -> int:
    """Bytes one plain forward and loss of the whole batch saves, as a round method's worker trains: every
    block's saved tensors and the whole batch's float32 logits with their log-softmax."""
    logits = job.batch_size * job.seq * job.arch().vocab_size * 4
    return activations(job, StepLayout()).saved(recompute=False) + 2 * logits


def head_bytes(job: JobConfig, layout: StepLayout, tokens: int, wire_bytes: int) -> int:
    """The head and loss of one chunk at their peak (`cleave.gemm.head`, which holds one phase's buffers at a
    time): the running sum of dW over the chunks (float32), and beside it the largest phase: the chunk's logits
    with their float32 copy and softmax (the loss, then its gradient); the gradient and its transposed copy
    dYᵀ; dYᵀ and the chunk's dW; dYᵀ with two of the input gradient's slices in flight (their Wᵀ and dYᵀ
    slices and products)."""
    cfg = job.arch()
    rows = tokens // layout.head_chunks
    chunk, vd = rows * cfg.vocab_size, cfg.vocab_size * cfg.n_embd
    out = 4 if job.precision == "fp32" else 2  # the products' bytes (a bf16/fp16 job's come back rounded)
    width = -(-cfg.vocab_size // layout.head_slices)
    phases = (
        chunk * (out + (4 if out != 4 else 0) + 4),  # logits, their float32 copy, the softmax
        chunk * (4 + wire_bytes),  # the gradient and dYᵀ
        chunk * wire_bytes + vd * out,  # dYᵀ and the chunk's dW
        chunk * wire_bytes + 2 * width * (cfg.n_embd + rows) * wire_bytes + 2 * rows * cfg.n_embd * 4,  # slices
    )
    return vd * 4 + max(phases)


def estimate(job: JobConfig, workers: int, tile_bytes: int = 4, deferred: int = DEFAULT_DEFERRED,
             replicas: int = 1, pool: int = 0) -> Estimate:
    """The PS's memory for `job`; `pool`: the PS's product_pool_bytes (counted where an output reaches the
    pool's smallest size)."""
    cfg = job.arch()
    layout = job.layout(replicas)
    meta = build_model(cfg, device="meta")
    params = sum(p.numel() for p in meta.parameters())
    shapes = gemm_shapes(cfg, job.batch_size // replicas, job.seq, layout)
    tokens = job.batch_size // replicas // layout.micro_batches * job.seq

    def buffers(g: GemmShape) -> int:
        return (g.m * g.k + g.k * g.n) * tile_bytes + g.m * g.n * 4

    dws = sorted((buffers(g) for g in shapes if g.name.endswith(".dw") and not g.name.startswith(HEAD)
                  for _ in range(g.count_per_step)), reverse=True)  # (the head's are not deferred: cleave.gemm.head)
    bus = max(buffers(g) for g in shapes) + sum(dws[:deferred])
    largest = max((_largest_block(g, workers, tile_bytes) for g in shapes), key=lambda t: t[-1])
    kmax = max(g.k for g in shapes)
    thin = int(tile_memory_bytes(np.array([MIN_BLOCK]), np.array([MIN_BLOCK]), kmax, tile_bytes)[0])
    return Estimate(params=params, weights=4 * params, grads=4 * params, optimizer=8 * params,
                    activations=activations(job, layout, replicas).saved(layout.recompute),
                    head=head_bytes(job, layout, tokens, tile_bytes), head_grad=cfg.vocab_size * cfg.n_embd * 4, bus=bus,
                    deferred=(deferred, sum(dws[:deferred])), checkpoint=CHECKPOINT_BUFFER_BYTES,
                    runtime=RUNTIME_BYTES, layout=layout, largest_tile=largest,
                    smallest_tile=thin, dw_buffers=tuple(dws),
                    pool=pool if max(g.m * g.n * 4 for g in shapes) >= MAPPED_BYTES else 0)


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


@dataclass(frozen=True)
class Memory:
    """What the PS may use: host memory, and a GPU's free memory where it trains on one."""

    host: int
    gpu: int | None = None  # None: the PS trains on the CPU
    gpu_name: str = ""
    host_from: str = "host memory"  # where `host` comes from: the machine, or the setting that overrides it

    def lines(self) -> list[str]:
        out = [f"available    {self.host / GB:10.2f} GB  ({self.host_from})"]
        if self.gpu is not None:
            out.append(f"available    {self.gpu / GB:10.2f} GB  (free on {self.gpu_name})")
        return out


def ps_memory(job: JobConfig, memory_bytes: int = 0) -> Memory:
    """The memory the PS of `job` may use on this machine: `memory_bytes` (CLEAVE_PS_MEMORY_BYTES) or the
    host's available memory, and where it trains on CUDA the GPU's free memory."""
    host = memory_bytes or available_memory()
    said = "the PS's memory_bytes setting, CLEAVE_PS_MEMORY_BYTES" if memory_bytes else "host memory"
    device = resolve_device(job.device)
    if device.type != "cuda":
        return Memory(host, host_from=said)
    free, _total = torch.cuda.mem_get_info(device)
    return Memory(host, int(free), torch.cuda.get_device_name(device), said)


def fits(est: Estimate, memory: Memory) -> bool:
    """Whether the job fits, the freed outputs aside (they get only the room it leaves: `spare_pool`)."""
    est = replace(est, pool=0)
    if memory.gpu is None:
        return est.total <= memory.host
    return est.model_bytes <= memory.gpu and est.host_bytes <= memory.host


def resolve(job: JobConfig, memory: Memory, workers: int, **kw: object) -> tuple[JobConfig, Estimate]:
    """`job` with `recompute` decided (when left None: on only if the job does not fit without it) and its
    estimate; when it still does not fit, with fewer of the PS's weight gradients deferred than `deferred`: the
    most that fit (the estimate's `deferred` says how many; the PS deals that many); its freed outputs in the
    room left (`spare_pool`: the PS keeps that many bytes)."""
    if job.recompute is None:
        plain = job.model_copy(update={"recompute": False})
        est = estimate(plain, workers, **kw)
        if fits(est, memory):
            return plain, spare_pool(est, memory)
        job = job.model_copy(update={"recompute": True})
    return job, spare_pool(fewer_deferred(estimate(job, workers, **kw), memory), memory)


def spare_pool(est: Estimate, memory: Memory) -> Estimate:
    """`est` with the PS's freed outputs kept to reuse cut to the host memory the job leaves (none where it
    does not fit): they speed the PS up, and so never cost a job its fit, recomputation or deferred GEMMs."""
    room = memory.host - (est.total if memory.gpu is None else est.host_bytes) + est.pool
    return replace(est, pool=max(0, min(est.pool, room)))


def fewer_deferred(est: Estimate, memory: Memory) -> Estimate:
    """`est` with the most deferred weight gradients, up to its own count, that fit in `memory` (`est` if
    none do: the refusal then names what else to change)."""
    return next((e for e in map(est.deferring, range(est.deferred[0], -1, -1)) if fits(e, memory)), est)


def _knobs(job: JobConfig, est: Estimate, room: int) -> list[str]:
    """What to change, the knob that frees most first."""
    knobs = []
    per_token = est.activations + est.head + est.bus
    if not est.layout.recompute and est.activations > 0.1 * est.total:
        knobs.append("set recompute=true (--recompute: each block keeps only its input and runs its forward "
                     f"again in the backward; activations now {est.activations / GB:.2f} GB)")
    if per_token >= est.total - room or per_token > 0.25 * est.total:
        knobs.append(f"raise micro_batches (now {job.micro_batches}: the batch in equal parts, gradients "
                     f"accumulated) or lower batch_size (now {job.batch_size}) or seq_len (now {job.seq}): "
                     f"activations, the head and bus buffers take {per_token / GB:.2f} GB and scale with them")
    count, held = est.deferred
    if held and est.total - held <= room:
        knobs.append(f"lower the PS's deferred_gemms (CLEAVE_PS_DEFERRED_GEMMS, now {count}: the weight gradients "
                     f"dealt beside the backward hold {held / GB:.2f} GB of bus buffers; 0 deals one GEMM at a time)")
    if est.weights + est.grads + est.optimizer + est.runtime > room or not knobs:
        knobs.append("choose a smaller model (preset) or give the PS more memory (a larger machine, or "
                     "CLEAVE_PS_MEMORY_BYTES if the detected amount is wrong)")
    return knobs


def check(job: JobConfig, est: Estimate, memory: Memory | int,
          worker_memory: int | list[int] = DEFAULT_WORKER_MEMORY) -> None:
    """Refuse a job that cannot fit, with the numbers and the knob to change; `worker_memory`: the workers'
    declared budgets (the registry's), or one assumed for all."""
    memory = memory if isinstance(memory, Memory) else Memory(memory)
    if not fits(est, memory):
        where, need, room = ((f"its GPU ({memory.gpu_name})", est.model_bytes, memory.gpu)
                             if memory.gpu is not None and est.model_bytes > memory.gpu else
                             ("the PS", est.total if memory.gpu is None else est.host_bytes, memory.host))
        raise ConfigError(
            f"job {job.job_id!r} needs about {need / GB:.2f} GB on {where} (weights {est.weights / GB:.2f}, "
            f"gradients {est.grads / GB:.2f}, AdamW {est.optimizer / GB:.2f}, activations "
            f"{est.activations / GB:.2f}, head {est.head / GB:.2f}, bus {est.bus / GB:.2f}, free outputs "
            f"{est.pool / GB:.2f}, runtime {est.runtime / GB:.2f}; peak at {est.peak_phase}) but {room / GB:.2f} GB are available; to fit, "
            + "; or ".join(_knobs(job, est, room)))
    budgets = worker_memory if isinstance(worker_memory, list) else [worker_memory]
    if budgets and est.smallest_tile > max(budgets):
        raise ConfigError(
            f"the thinnest tile of job {job.job_id!r} needs {est.smallest_tile / 2**20:.2f} MiB on a worker, over "
            f"every worker's memory_bytes (at most {max(budgets) / 2**20:.2f} MiB); give workers more memory "
            f"(CLEAVE_WORKER_MEMORY_BYTES) or use a smaller model (preset)")
