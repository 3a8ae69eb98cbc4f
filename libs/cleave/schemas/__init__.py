"""Every wire message (pydantic, frozen, unknown fields ignored) and every NATS subject and bucket name.

Messages travel as msgpack through `cleave.codec`; tensors inside them as `TensorData` (dtype, shape, bytes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    model_serializer,
    model_validator,
)

from cleave.schemas import planwire

# ---- subjects, streams and buckets -------------------------------------------------------------------
PREFIX = "cleave"
SUBJECT_HEARTBEAT = PREFIX + ".hb.{worker_id}"  # worker -> scheduler: liveness and profile
SUBJECT_HEARTBEAT_ALL = PREFIX + ".hb.*"
SUBJECT_TILES = PREFIX + ".tile.{worker_id}"  # PS -> one worker: tiles to compute
SUBJECT_FANOUT = PREFIX + ".fan.{job}.{epoch}.{group}"  # PS -> every worker of a group: a shared input block
SUBJECT_CONTROL = PREFIX + ".ctl.{worker_id}"  # PS -> one worker (request/reply): join fan-out groups
SUBJECT_LINKCHECK = PREFIX + ".check.{worker_id}"  # PS -> a returning worker (request/reply): prove its downlink
# worker -> PS: finished blocks, on the worker's own subject (per-worker credentials may publish only there);
# the PS subscribes with worker_id="*" and checks that a message's worker_id is the subject's
SUBJECT_RESULTS = PREFIX + ".result.{job}.{epoch}.{worker_id}"
SUBJECT_ROUNDS = PREFIX + ".round.{worker_id}"  # PS -> one worker: train locally for a round (diloco, fedavg)
SUBJECT_ROUNDCAST = PREFIX + ".roundcast.{job}"  # PS -> every worker of a round at once: NATS fans it out
SUBJECT_ROUNDCAST_ALL = PREFIX + ".roundcast.*"  # what workers subscribe to
MAX_ROUND_WORKERS = 100_000  # workers named in one broadcast round
SUBJECT_UPDATES = PREFIX + ".update.{job}.{epoch}.{worker_id}"  # worker -> PS: a round's update, a split reply
SUBJECT_SPLIT = PREFIX + ".split.{worker_id}"  # PS -> the split-learning client: run a step's half
SUBJECT_PROBE = PREFIX + ".probe"  # worker -> scheduler (request/reply): latency and bandwidth probes
SUBJECT_EVENTS = PREFIX + ".events.{kind}"  # anyone -> monitor (JetStream stream EVENTS_STREAM)
SUBJECT_EVENTS_ALL = PREFIX + ".events.>"

EVENTS_STREAM = "CLEAVE_EVENTS"
REGISTRY_BUCKET = "cleave-registry"  # key: worker id -> DeviceRecord; entries expire without heartbeats
PLAN_BUCKET = "cleave-plans"  # key: PLAN_KEY -> Plan
PLAN_KEY = "current"
SHAPES_KEY = "shapes"  # key in PLAN_BUCKET: the running job's JobShapes
REPLICA_PLAN_KEY = PLAN_KEY + ".r{replica}"  # key in PLAN_BUCKET: PS replica r's part of the fleet (--ps-replicas)
MAX_PS_REPLICAS = 64
STATE_BUCKET = "cleave-state"  # PS persistence head records
STATE_OBJECTS = "cleave-state-objects"  # PS persistence tensors (Object Store)

# ---- limits ------------------------------------------------------------------------------------------
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # any reassembled message
MAX_CONTROL_BYTES = 1024 * 1024  # heartbeats, events, job shapes
MAX_PLAN_BYTES = 32 * 1024 * 1024  # a plan once decompressed (10,000 devices: ~3.5 MB; its frame stays < 1 MB)
MAX_TENSOR_ELEMENTS = 1 << 28
MAX_GEMM_DIM = 1 << 31  # m, n or k of a planned GEMM (box coordinates travel as int32)
MAX_PROBE_BYTES = 4 * 1024 * 1024
MAX_BLOCK_PARTS = 256  # segments of one input block (`cleave.gemm.fanout.parts` sends a block needing more whole)
MAX_LINKCHECK_BYTES = 1024 * 1024
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


COMPUTE_DTYPE_BYTES = 4  # a worker computes every tile in float32: what an element takes in its memory


class JobShapes(Wire):
    """What the PS tells the scheduler about its job so that the plan can be cost-aware."""

    job: str
    gemms: tuple[GemmSpec, ...]  # with replicas > 1: one replica's share of the batch
    dtype_bytes: int = 4  # an input or output element on the links (2 for a bf16 or fp16 job)
    memory_dtype_bytes: int | None = None  # ... in a worker's memory (its tiles compute in float32); None: the same
    replicas: int = Field(1, ge=1, le=MAX_PS_REPLICAS)  # PS replicas, each planned its own part of the fleet


BoxesField = Annotated[planwire.Boxes, PlainValidator(planwire.boxes_in), PlainSerializer(lambda b: b.tolist())]
OwnersField = Annotated[planwire.Owners, PlainValidator(planwire.owners_in), PlainSerializer(lambda o: list(o))]


class GemmLayout(Wire):
    """The planner's blocks for GEMMs of shape (m, n, k): box i is rows boxes[4i]:boxes[4i+1] and columns
    boxes[4i+2]:boxes[4i+3] of the output, planned for device owners[i]. Inside a Plan on the wire, both
    travel packed (`cleave.schemas.planwire`); `boxes.array` and `owners.index` are their numpy forms."""

    m: int = Field(gt=0, le=MAX_GEMM_DIM)
    n: int = Field(gt=0, le=MAX_GEMM_DIM)
    k: int = Field(gt=0, le=MAX_GEMM_DIM)
    boxes: BoxesField
    owners: OwnersField
    makespan_s: float = 0.0

    @model_validator(mode="after")
    def _boxes_fit(self) -> GemmLayout:
        if len(self.boxes) != 4 * len(self.owners):
            raise ValueError(f"{len(self.boxes)} box integers for {len(self.owners)} owners (4 each)")
        planwire.check_boxes(self.boxes.flat, self.m, self.n)
        return self


def _plan_worker(cols: planwire.WorkerColumns, i: int) -> PlanWorker:
    f, n = cols.floats, cols.ints
    profile = DeviceProfile(flops=float(f["flops"][i]), memory_bytes=int(n["memory_bytes"][i]),
                            downlink_bytes_per_s=float(f["downlink_bytes_per_s"][i]),
                            uplink_bytes_per_s=float(f["uplink_bytes_per_s"][i]), latency_s=float(f["latency_s"][i]),
                            declared=bool(cols.declared[i]))
    return PlanWorker(worker_id=cols.ids[i], profile=profile, cache_bytes=int(n["cache_bytes"][i]))


def _workers_in(v: Any) -> planwire.WorkerTable:
    if isinstance(v, planwire.WorkerTable):
        return v
    if isinstance(v, Mapping):  # the packed columns
        return planwire.WorkerTable(planwire.unpack_workers(v), _plan_worker)
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise ValueError("workers must be a sequence of PlanWorker or the packed columns")
    items = tuple(PlanWorker.model_validate(w) for w in v)
    cols = planwire.WorkerColumns.of(items)
    return planwire.WorkerTable(cols, _plan_worker, items)


WorkersField = Annotated[planwire.WorkerTable, PlainValidator(_workers_in), PlainSerializer(lambda t: list(t))]


class Plan(Wire):
    """Which workers take part and how the GEMMs are cut; published by the scheduler.

    On the wire (`model_dump`, what the codec sends) the workers are packed columns and each layout's boxes
    and owners packed arrays (`cleave.schemas.planwire`): 10,000 devices fit in well under 1 MB. In Python,
    `plan.workers` is a sequence of PlanWorker (with `.ids` and `.columns` for numpy users)."""

    version: int
    created_at: float
    workers: WorkersField
    tile_rows: int = Field(gt=0)  # largest block sent as one tile (planned blocks are cut to this size)
    tile_cols: int = Field(gt=0)
    chunks: int = Field(1, ge=1, le=64)  # a planned block is sent as at least this many pieces, streamed
    gemms: tuple[GemmLayout, ...] = ()  # per GEMM shape; a shape not listed is dealt as a uniform grid
    predicted_step_s: float | None = None  # the planner's step time for the job's GEMMs
    lower_bound_s: float | None = None
    planner: str = "uniform"
    reason: str = ""  # why this plan was made: "join", "leave", "start", ...

    @model_validator(mode="before")
    @classmethod
    def _unpack(cls, data: Any) -> Any:
        """The packed wire form (workers as a map of columns) to layouts whose owners index those workers."""
        if not isinstance(data, dict) or not isinstance(data.get("workers"), Mapping):
            return data
        table = _workers_in(data["workers"])
        gemms = data.get("gemms", ())
        if not isinstance(gemms, (list, tuple)):
            raise ValueError("gemms must be a list")
        return {**data, "workers": table, "gemms": tuple(_unpack_layout(g, table.ids) for g in gemms)}

    @model_validator(mode="after")
    def _owners_are_workers(self) -> Plan:
        foreign = [g for g in self.gemms if g.owners.table is not self.workers.ids]  # none once decoded
        known = set(self.workers.ids) if foreign else set()
        for g in foreign:
            if not known.issuperset(g.owners.table):
                stranger = next(w for w in g.owners.table if w not in known)
                raise ValueError(f"layout {g.m}x{g.n}x{g.k} names {stranger!r}, not a worker of the plan")
        return self

    @model_serializer(mode="plain")
    def _packed(self) -> dict[str, Any]:
        ids = self.workers.ids
        position = {w: i for i, w in enumerate(ids)}
        doc = {f: getattr(self, f) for f in type(self).model_fields if f not in ("workers", "gemms")}
        doc["workers"] = planwire.pack_workers(self.workers.columns)
        doc["gemms"] = [
            {"m": g.m, "n": g.n, "k": g.k, "makespan_s": g.makespan_s, "boxes": planwire.pack_boxes(g.boxes.array),
             "owners": g.owners.indices_in(ids, position).tobytes()}
            for g in self.gemms
        ]
        return doc


def _unpack_layout(doc: Any, ids: tuple[str, ...]) -> dict[str, Any]:
    """A packed layout as the fields GemmLayout validates (once, as a field of the Plan)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("boxes"), bytes) or not isinstance(doc.get("owners"), bytes):
        raise ValueError("a packed layout needs bytes fields boxes and owners")
    flat = planwire.unpack_boxes(doc["boxes"])
    owners = planwire.Owners(planwire.unpack_owners(doc["owners"], len(flat) // 4, len(ids)), ids)
    return {**doc, "boxes": planwire.Boxes(flat), "owners": owners}


class BlockPart(Wire):
    """One segment of a block's rows (`BlockRef.parts`)."""

    id: str = Field(max_length=256)
    tensor: TensorData | None = None
    fanout: bool = False


class BlockRef(Wire):
    """An input block of a tile: its id, and its data unless the worker already caches it or it comes on a
    fan-out subject (`fanout`: wait briefly for it before answering that it is missing); or, with `parts`,
    the blocks (segments of its rows, each as above) whose concatenation it is (`cleave.gemm.fanout.parts`)."""

    id: str = Field(max_length=256)
    tensor: TensorData | None = None
    fanout: bool = False
    parts: tuple[BlockPart, ...] = Field((), max_length=MAX_BLOCK_PARTS)



class BlockPush(Wire):
    """PS -> a fan-out group: one input block that several planned workers need, published once."""

    job: str
    epoch: int
    gemm: int
    block: BlockRef


class FanoutJoin(Wire):
    """PS -> one worker: subscribe to these fan-out subjects (and leave the job's others)."""

    job: str
    epoch: int
    version: int  # the plan they were made for
    subjects: tuple[str, ...] = Field((), max_length=4096)


class LinkCheck(Wire):
    """PS -> a worker that came back: a small round trip over the connection its tiles take, before any tile.
    Tiles of `job` and `epoch` sent before `sent_at` (PS clock) were given back when it left: it drops them."""

    job: str = ""
    epoch: int = 0
    sent_at: float = 0.0
    payload: bytes = Field(b"", max_length=MAX_LINKCHECK_BYTES)


class LinkCheckAck(Wire):
    worker_id: str = Field(min_length=1, max_length=128)


class FanoutAck(Wire):
    worker_id: str
    joined: tuple[str, ...] = Field((), max_length=4096)
    error: str = ""


class TileTask(Wire):
    """Compute out = a · btᵀ for one output block: a = A[r0:r1, :], bt = Bᵀ[c0:c1, :] (K never split)."""

    job: str
    epoch: int  # PS incarnation: results for an older epoch are fenced off
    step: int
    op: int  # GEMM sequence number within the step
    gemm: int = 0  # the GEMM run within the PS epoch (a step redone runs its GEMMs again): echoed in the result
    tile: int
    attempt: int = 0
    a: BlockRef
    b: BlockRef
    reply: str  # subject for the result
    sent_at: float = 0.0
    # the product's precision on the way back: "" float32; a bf16/fp16 job's GEMMs round it once, and the
    # worker rounding its block is the same rounding (and half the bytes)
    rounded: Literal["", "bfloat16", "float16"] = ""


class TileResult(Wire):
    job: str
    epoch: int
    step: int
    op: int
    gemm: int = 0  # the task's GEMM run: a result for any other run is dropped
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
    reply: str  # where the update goes; "{worker_id}" in it stands for the answering worker's id
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
    tiles_copied: int = 0  # speculative copies sent (a straggler's or a silent worker's tiles redone elsewhere)
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
    checkpoint_s: float = 0.0  # seconds spent after this step streaming the state to JetStream (0: not due)
    replica_wait_s: float = 0.0  # PS replicas: waiting for the slowest replica's backward (a barrier)
    allreduce_s: float = 0.0  # PS replicas: the gradient all-reduce itself
    at: float = 0.0


class TensorEntry(Wire):
    """One tensor of a streamed checkpoint: its bytes follow the previous entry's in the data object."""

    key: str = Field(max_length=256)  # "model.<key>" or "opt.<param index>.<name>"
    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    shape: tuple[int, ...] = Field(max_length=8)


class CheckpointManifest(Wire):
    """The PS's state after a committed step (data position = step + 1): the tensors' raw bytes stream in
    `data_object`, in the order of `tensors`, hashed every `chunk_bytes` bytes; RNG and optimizer groups here."""

    job: str
    step: int
    epoch: int
    created_at: float
    data_object: str
    size: int = Field(ge=0)  # bytes in data_object
    chunk_bytes: int = Field(gt=0)
    chunk_sha256: tuple[str, ...] = Field(max_length=1 << 20)
    tensors: tuple[TensorEntry, ...] = Field(max_length=1 << 20)
    optimizer_groups: list[dict[str, Any]]
    rng: TensorData


MAX_MANIFEST_BYTES = 64 * 1024 * 1024


class StateHead(Wire):
    """The small KV record naming the last committed checkpoint; updated by compare-and-set, last."""

    job: str
    step: int  # last committed step
    epoch: int
    object: str  # the CheckpointManifest's object
    sha256: str  # of the manifest object
    size: int  # of the checkpoint's data object
    job_config: str  # the JSON job description the state belongs to
    metrics: tuple[StepMetrics, ...] = ()  # the steps this commit made durable (their --metrics-out lines)


