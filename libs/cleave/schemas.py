"""Every wire message (pydantic, frozen, unknown fields ignored) and every NATS subject and bucket name.

Messages travel as msgpack through `cleave.codec`; tensors inside them as `TensorData` (dtype, shape, bytes).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# ---- subjects, streams and buckets -------------------------------------------------------------------
PREFIX = "cleave"
SUBJECT_HEARTBEAT = PREFIX + ".hb.{worker_id}"  # worker -> scheduler: liveness and profile
SUBJECT_HEARTBEAT_ALL = PREFIX + ".hb.*"
SUBJECT_TILES = PREFIX + ".tile.{worker_id}"  # PS -> one worker: tiles to compute
SUBJECT_RESULTS = PREFIX + ".result.{job}.{epoch}"  # worker -> PS: finished blocks
SUBJECT_ROUNDS = PREFIX + ".round.{worker_id}"  # PS -> one worker: train locally for a round (diloco, fedavg)
SUBJECT_ROUNDCAST = PREFIX + ".roundcast.{job}"  # PS -> every worker of a round at once: NATS fans it out
SUBJECT_ROUNDCAST_ALL = PREFIX + ".roundcast.*"  # what workers subscribe to
MAX_ROUND_WORKERS = 100_000  # workers named in one broadcast round
SUBJECT_UPDATES = PREFIX + ".update.{job}.{epoch}"  # worker -> PS: a round's update, a split step's reply
SUBJECT_SPLIT = PREFIX + ".split.{worker_id}"  # PS -> the split-learning client: run a step's half
SUBJECT_PROBE = PREFIX + ".probe"  # worker -> scheduler (request/reply): latency and bandwidth probes
SUBJECT_EVENTS = PREFIX + ".events.{kind}"  # anyone -> monitor (JetStream stream EVENTS_STREAM)
SUBJECT_EVENTS_ALL = PREFIX + ".events.>"

EVENTS_STREAM = "CLEAVE_EVENTS"
REGISTRY_BUCKET = "cleave-registry"  # key: worker id -> DeviceRecord; entries expire without heartbeats
PLAN_BUCKET = "cleave-plans"  # key: PLAN_KEY -> Plan
PLAN_KEY = "current"
SHAPES_KEY = "shapes"  # key in PLAN_BUCKET: the running job's JobShapes
STATE_BUCKET = "cleave-state"  # PS persistence head records
STATE_OBJECTS = "cleave-state-objects"  # PS persistence tensors (Object Store)

# ---- limits ------------------------------------------------------------------------------------------
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # any reassembled message
MAX_CONTROL_BYTES = 1024 * 1024  # heartbeats, plans, events
MAX_TENSOR_ELEMENTS = 1 << 28
MAX_PROBE_BYTES = 4 * 1024 * 1024
COMPRESSION_KINDS = ("none", "fp16", "bf16", "int8", "topk", "topkq")
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8")
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1}


class Wire(BaseModel):
    """Base of all messages: immutable, and open-world (fields a newer peer adds are ignored)."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class TensorData(Wire):
    """A dense tensor: dtype name, shape and raw little-endian bytes (bf16 travels as its bits)."""

    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    shape: tuple[int, ...] = Field(max_length=8)
    data: bytes

    @model_validator(mode="after")
    def _size_matches(self) -> TensorData:
        if any(d < 0 or d > MAX_TENSOR_ELEMENTS for d in self.shape):
            raise ValueError(f"dimension out of range in shape {self.shape}")
        n = math.prod(self.shape)
        if n > MAX_TENSOR_ELEMENTS:
            raise ValueError(f"shape {self.shape} declares {n} elements, over the limit {MAX_TENSOR_ELEMENTS}")
        if n * DTYPE_SIZES[self.dtype] != len(self.data):
            raise ValueError(f"shape {self.shape} of {self.dtype} needs {n * DTYPE_SIZES[self.dtype]} bytes, got {len(self.data)}")
        return self


class Packed(Wire):
    """One compressed tensor: what the codec sends in place of a `TensorData`."""

    kind: Literal[COMPRESSION_KINDS]  # type: ignore[valid-type]
    dtype: Literal[DTYPES]  # type: ignore[valid-type]  # the original dtype, restored on decompression
    shape: tuple[int, ...] = Field((), max_length=8)
    values: TensorData  # the cast tensor, the int8 codes, or the kept top-k values
    scales: TensorData | None = None  # int8: one float32 scale per block; topkq: the lowest and highest magnitude
    indices: TensorData | None = None  # topk, topkq: int32 deltas of the sorted flat positions of `values`
    block: int = 0  # int8: values per scale; topkq: bits per kept value (packed into uint8 `values`)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data carried (before the codec's msgpack framing and optional zstd)."""
        return sum(len(t.data) for t in (self.values, self.scales, self.indices) if t is not None)


class PackedTensors(Wire):
    """A named set of compressed tensors (a pseudo-gradient, a weight delta, LoRA adapters)."""

    tensors: dict[str, Packed]


class DeviceProfile(Wire):
    """What a device offers, measured at registration or declared for an emulated fleet."""

    flops: float = Field(gt=0)  # sustained GEMM FLOP/s
    memory_bytes: int = Field(gt=0)  # budget for input blocks and the output block of one tile
    downlink_bytes_per_s: float = Field(gt=0)
    uplink_bytes_per_s: float = Field(gt=0)
    latency_s: float = Field(ge=0)
    declared: bool = False  # True when the worker paces itself to honour a declared profile


class Probe(Wire):
    """A link probe: `payload` carries the upload; the echo carries `reply_bytes` back down."""

    payload: bytes = Field(b"", max_length=MAX_PROBE_BYTES)
    reply_bytes: int = Field(0, ge=0, le=MAX_PROBE_BYTES)


class Heartbeat(Wire):
    worker_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    profile: DeviceProfile
    sent_at: float
    started_at: float
    cache_bytes: int = 0
    tiles_done: int = 0
    busy_s: float = 0.0


class DeviceRecord(Wire):
    """A registry entry (JetStream KV), written by the scheduler from heartbeats."""

    worker_id: str
    profile: DeviceProfile
    first_seen: float
    last_seen: float
    cache_bytes: int = 0
    tiles_done: int = 0


class PlanWorker(Wire):
    worker_id: str
    profile: DeviceProfile
    cache_bytes: int = 0  # the worker's input-block cache; the PS mirrors it to avoid resending blocks


class GemmSpec(Wire):
    """One GEMM kind of a job's step: C[m, n] = A[m, k] · B[k, n], run count_per_step times."""

    name: str
    m: int = Field(gt=0)
    n: int = Field(gt=0)
    k: int = Field(gt=0)
    count_per_step: int = Field(1, gt=0)


class JobShapes(Wire):
    """What the PS tells the scheduler about its job so that the plan can be cost-aware."""

    job: str
    gemms: tuple[GemmSpec, ...]
    dtype_bytes: int = 4


class GemmLayout(Wire):
    """The planner's blocks for GEMMs of shape (m, n, k): box i is rows boxes[4i]:boxes[4i+1] and columns
    boxes[4i+2]:boxes[4i+3] of the output, planned for device owners[i]."""

    m: int
    n: int
    k: int
    boxes: tuple[int, ...]
    owners: tuple[str, ...]
    makespan_s: float = 0.0


class Plan(Wire):
    """Which workers take part and how the GEMMs are cut; published by the scheduler."""

    version: int
    created_at: float
    workers: tuple[PlanWorker, ...]
    tile_rows: int = Field(gt=0)  # largest block sent as one tile (planned blocks are cut to this size)
    tile_cols: int = Field(gt=0)
    chunks: int = Field(1, ge=1, le=64)  # a planned block is sent as at least this many pieces, streamed
    gemms: tuple[GemmLayout, ...] = ()  # per GEMM shape; a shape not listed is dealt as a uniform grid
    predicted_step_s: float | None = None  # the planner's step time for the job's GEMMs
    lower_bound_s: float | None = None
    planner: str = "uniform"
    reason: str = ""  # why this plan was made: "join", "leave", "start", ...


class BlockRef(Wire):
    """An input block of a tile: its id, and its data unless the worker already caches it."""

    id: str = Field(max_length=256)
    tensor: TensorData | None = None


class TileTask(Wire):
    """Compute out = a · btᵀ for one output block: a = A[r0:r1, :], bt = Bᵀ[c0:c1, :] (K never split)."""

    job: str
    epoch: int  # PS incarnation: results for an older epoch are fenced off
    step: int
    op: int  # GEMM sequence number within the step
    tile: int
    attempt: int = 0
    a: BlockRef
    b: BlockRef
    reply: str  # subject for the result
    sent_at: float = 0.0


class TileResult(Wire):
    job: str
    epoch: int
    step: int
    op: int
    tile: int
    attempt: int
    worker_id: str
    out: TensorData | None = None
    missing: tuple[str, ...] = ()  # block ids the worker no longer caches: resend with data
    error: str = ""
    compute_s: float = 0.0


class Event(Wire):
    """Something that happened: a worker joined or left, a recovery, a plan change, a PS restart."""

    kind: str  # snake_case past tense: worker_joined, worker_lost, recovered, ps_resumed, ...
    at: float
    job: str = ""
    step: int | None = None
    worker_id: str | None = None
    cause: str = ""
    detect_s: float | None = None
    redispatch_s: float | None = None
    complete_s: float | None = None
    detail: dict[str, str | int | float | bool | None] = Field(default_factory=dict)


class RoundTask(Wire):
    """Start round `round` of a data-parallel method: load `weights`, train `local_steps` steps, reply."""

    job: str
    epoch: int
    method: Literal["diloco", "fedavg"]
    round: int
    job_config: str  # the JobConfig JSON: model, optimizer, data, compression, LoRA
    weights: PackedTensors  # the global trainable parameters (lossless)
    shard: int = 0  # which slice of the job's data this worker trains on (0: the reference run's batches)
    reply: str
    # broadcast (SUBJECT_ROUNDCAST): the round's workers and each one's shard; a worker not named ignores it
    shards: dict[str, int] = Field(default_factory=dict, max_length=MAX_ROUND_WORKERS)


class RoundUpdate(Wire):
    job: str
    epoch: int
    round: int
    worker_id: str
    delta: PackedTensors | None = None  # pseudo-gradient (diloco) or weight delta (fedavg), compressed
    weight: float = 0.0  # tokens or samples trained on: the aggregation weight
    losses: tuple[float, ...] = ()
    raw_bytes: int = 0  # the delta's size before compression
    error: str = ""


class SplitTask(Wire):
    """Split learning, PS -> client. `forward`: run the client half on batch `step` and send the cut.
    `backward`: here is the gradient at the cut; finish the step and send the clip coefficient.
    `eval`: the cut (and labels) of the validation batches after step `step`, nothing trained (val_every)."""

    job: str
    epoch: int
    step: int
    phase: Literal["forward", "backward", "eval"]
    job_config: str
    split_layers: int = Field(ge=0)
    reply: str
    grad: TensorData | None = None
    tied_grad: TensorData | None = None
    grad_sq_norm: float = 0.0
    loss: float = 0.0


class SplitReply(Wire):
    job: str
    epoch: int
    step: int
    phase: Literal["forward", "backward", "eval"]
    worker_id: str
    activations: TensorData | None = None
    tied_weight: TensorData | None = None
    targets: TensorData | None = None  # the labels: the server half computes the loss
    clip_coef: float = 1.0
    error: str = ""


class StepMetrics(Wire):
    """One line of `--metrics-out` and of the monitor's loss curve."""

    job: str = ""
    method: str = "cleave"
    step: int
    loss: float
    step_time_s: float
    workers: int
    tiles: int = 0
    tiles_resent: int = 0
    tiles_dropped: int = 0  # late or duplicate results
    rejected: int = 0  # malformed or invalid results
    bytes_down: int = 0  # PS -> workers (what leaves the PS)
    bytes_down_per_worker: int = 0  # what each worker receives (a broadcast round: the same message for all)
    bytes_up: int = 0  # workers -> PS
    tokens: int = 0
    lr: float = 0.0
    val_loss: float | None = None
    recoveries: int = 0
    gemm_s: float = 0.0  # of step_time_s, the wall time of the distributed GEMMs; the rest is the PS's own work
    predicted_gemm_s: float | None = None  # the plan's makespans of this step's GEMMs (None: not all planned)
    predicted_step_s: float | None = None  # predicted_gemm_s + the PS's own time in its previous steps
    raw_bytes_up: int = 0  # what the workers' updates weighed before compression (data-parallel methods)
    updates: int = 0  # updates applied this round (data-parallel methods)
    updates_dropped: int = 0  # late, duplicate or invalid updates
    updates_late: int = 0  # of `updates`, late ones folded in (within max_staleness, weight 1/(1+age))
    applied: bool = True  # False: the round closed under min_updates and the global weights stayed
    recovery: tuple[Event, ...] = ()  # each recovery in this step: cause, detection, re-dispatch, completion
    resumed: bool = False  # this step ran on a PS that had restarted from persisted state
    at: float = 0.0


class Checkpoint(Wire):
    """The PS's state after a committed step: weights, optimizer state, RNG (data position = step + 1)."""

    job: str
    step: int
    epoch: int
    created_at: float
    tensors: dict[str, TensorData]  # "model.<key>" and "opt.<param index>.<name>"
    optimizer_groups: list[dict[str, Any]]
    rng: TensorData


class StateHead(Wire):
    """The small KV record naming the last committed checkpoint; updated by compare-and-set, last."""

    job: str
    step: int  # last committed step
    epoch: int
    object: str
    sha256: str
    size: int
    job_config: str  # the JSON job description the state belongs to
    metrics: tuple[StepMetrics, ...] = ()  # the steps this commit made durable (their --metrics-out lines)


