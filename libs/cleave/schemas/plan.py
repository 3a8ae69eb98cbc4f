"""The plan the scheduler publishes (workers and per-GEMM blocks, packed on the wire) and the job shapes it plans for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import Field, PlainSerializer, PlainValidator, model_serializer, model_validator

from cleave.schemas import planwire
from cleave.schemas.base import Wire
from cleave.schemas.fleet import DeviceProfile
from cleave.schemas.limits import MAX_GEMM_DIM, MAX_PS_REPLICAS


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
