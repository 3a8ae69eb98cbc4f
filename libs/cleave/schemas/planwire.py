"""The packed wire form of a plan (pure numpy): worker columns and each GEMM's boxes as little-endian bytes.

A plan for 10,000 devices holds 100,000-150,000 boxes; as msgpack lists that is over a million entries
and several MB. Packed, a GEMM's boxes are one bytes field of int32 columns, delta-coded so that the
codec's zstd (over the whole message) squeezes them: per box `r0 - previous r0`, `r1 - r0`,
`c0 - previous c1`, `c1 - c0` (a row band of side-by-side blocks is mostly zeros and widths). Its owners
are one bytes field of int32 indices into the plan's worker list. The workers travel as columns: ids
joined by newlines, float64 profiles, int64 sizes, one uint8 flag each.

`unpack_*` and `check_boxes` check every length and range and raise ValueError naming what is wrong (the
schema turns it into a WireError). `Boxes`, `Owners` and `WorkerTable` are the read-only sequences the
Python side reads (`layout.boxes`, `layout.owners`, `plan.workers`), unpacked lazily and cached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_PLAN_WORKERS = 1 << 17  # workers in one plan (131,072)
MAX_LAYOUT_BOXES = 1 << 21  # boxes in one GEMM's layout
BOX_BYTES = 16  # four int32 per box
_I32, _I64, _F64, _U8 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f8"), np.dtype("u1")
_ID_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"
MAX_ID = 128
PROFILE_FLOATS = ("flops", "downlink_bytes_per_s", "uplink_bytes_per_s", "latency_s")
WORKER_INTS = ("memory_bytes", "cache_bytes")


# ---- boxes and owners ---------------------------------------------------------------------------------
def pack_boxes(boxes: np.ndarray) -> bytes:
    """(n, 4) boxes (r0, r1, c0, c1) as delta-coded int32 columns."""
    r0, r1, c0, c1 = np.asarray(boxes, dtype=np.int64).reshape(-1, 4).T
    prev_r0 = np.concatenate([[0], r0[:-1]])
    prev_c1 = np.concatenate([[0], c1[:-1]])
    cols = np.stack([r0 - prev_r0, r1 - r0, c0 - prev_c1, c1 - c0])
    if cols.size and (cols.min() < np.iinfo(np.int32).min or cols.max() > np.iinfo(np.int32).max):
        raise ValueError("a box coordinate does not fit in int32")
    return cols.astype(_I32).tobytes()


def unpack_boxes(data: bytes) -> np.ndarray:
    """The flat int64 (r0, r1, c0, c1, ...) of `pack_boxes`' bytes (ranges are `check_boxes`' job)."""
    if len(data) % BOX_BYTES:
        raise ValueError(f"boxes take {BOX_BYTES} bytes each, got {len(data)} bytes")
    count = len(data) // BOX_BYTES
    if count > MAX_LAYOUT_BOXES:
        raise ValueError(f"{count} boxes in one layout, over the limit of {MAX_LAYOUT_BOXES}")
    dr0, height, dc0, width = np.frombuffer(data, dtype=_I32).astype(np.int64).reshape(4, count)
    out = np.empty((count, 4), dtype=np.int64)
    np.cumsum(dr0, out=out[:, 0])
    np.add(out[:, 0], height, out=out[:, 1])
    np.cumsum(dc0 + width, out=out[:, 3])
    np.subtract(out[:, 3], width, out=out[:, 2])
    flat = out.reshape(-1)
    flat.flags.writeable = False
    return flat


def check_boxes(flat: np.ndarray, m: int, n: int) -> None:
    """Raise ValueError unless every box lies inside the m x n output and their areas add up to m x n."""
    if flat.ndim != 1 or len(flat) % 4:
        raise ValueError(f"boxes hold 4 integers each, got {flat.shape}")
    r0, r1, c0, c1 = flat.reshape(-1, 4).T
    bad = ~((r0 >= 0) & (r0 < r1) & (r1 <= m) & (c0 >= 0) & (c0 < c1) & (c1 <= n))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"box {i} {tuple(flat[4 * i : 4 * i + 4].tolist())} is empty or outside the {m}x{n} output")
    areas = (r1 - r0) * (c1 - c0)  # each <= m * n < 2**62; their sum is checked in float first, so that the
    approx = float(areas.sum(dtype=np.float64))  # int64 sum of garbage cannot wrap around to m * n
    area = int(areas.sum()) if approx < 2.0**62 else int(approx)
    if len(r0) and area != m * n:
        raise ValueError(f"boxes cover {area} elements of the {m}x{n} = {m * n} output")


def unpack_owners(data: bytes, count: int, workers: int) -> np.ndarray:
    """int32 owner indices, one per box, each a position in the plan's worker list."""
    if len(data) != 4 * count:
        raise ValueError(f"{count} boxes need {4 * count} bytes of owners, got {len(data)}")
    index = np.frombuffer(data, dtype=_I32)
    if count and (index.min() < 0 or index.max() >= workers):
        raise ValueError(f"an owner index is outside the plan's {workers} workers")
    return index


def boxes_in(v: Any) -> Boxes:
    """A layout's `boxes` field from Python: Boxes, a numpy array or a sequence of ints."""
    if isinstance(v, Boxes):
        return v
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "iu":
            raise ValueError(f"boxes must be integers, got {v.dtype}")
        return Boxes(v)
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise ValueError("boxes must be a sequence of integers")
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in v):
        raise ValueError("boxes must be integers")
    return Boxes(v)


def owners_in(v: Any) -> Owners:
    """A layout's `owners` field from Python: Owners or a sequence of worker ids."""
    if isinstance(v, Owners):
        return v
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or not all(isinstance(x, str) for x in v):
        raise ValueError("owners must be a sequence of worker ids")
    return Owners.of(v)


class Boxes(Sequence[int]):
    """A layout's boxes, flat (r0, r1, c0, c1) per box, read as Python ints; `array` is the (n, 4) view."""

    __slots__ = ("flat", "_list")

    def __init__(self, values: np.ndarray | Iterable[int]) -> None:
        flat = np.array(values, dtype=np.int64).reshape(-1)
        flat.flags.writeable = False
        self.flat, self._list = flat, None

    @property
    def array(self) -> np.ndarray:
        return self.flat.reshape(-1, 4)

    def tolist(self) -> list[int]:
        if self._list is None:
            self._list = self.flat.tolist()
        return self._list

    def __len__(self) -> int:
        return len(self.flat)

    def __getitem__(self, i):  # a slice is a tuple, as it was when boxes were a tuple
        got = self.tolist()[i]
        return tuple(got) if isinstance(i, slice) else got

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Boxes):
            return np.array_equal(self.flat, other.flat)
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(self.flat.tobytes())

    def __repr__(self) -> str:
        return f"Boxes({len(self.flat) // 4} boxes)"


class Owners(Sequence[str]):
    """A layout's owner per box: `index` into `table`, the worker ids (the plan's, once decoded)."""

    __slots__ = ("index", "table", "_items")

    def __init__(self, index: np.ndarray, table: tuple[str, ...]) -> None:
        self.index, self.table, self._items = index, table, None

    @classmethod
    def of(cls, ids: Iterable[str]) -> Owners:
        pos: dict[str, int] = {}
        index = np.array([pos.setdefault(w, len(pos)) for w in ids], dtype=np.int32)
        return cls(index, tuple(pos))

    def items(self) -> tuple[str, ...]:
        if self._items is None:
            t = self.table
            self._items = tuple(t[i] for i in self.index.tolist())
        return self._items

    def indices_in(self, ids: tuple[str, ...], position: Mapping[str, int]) -> np.ndarray:
        """The owners as int32 positions in `ids` (`position[ids[i]] == i`); KeyError for a stranger."""
        if self.table is ids:
            return self.index.astype(_I32)
        return np.array([position[w] for w in self.table], dtype=_I32)[self.index]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        return self.items()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self.items())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and self.items() == tuple(other)

    def __hash__(self) -> int:
        return hash(self.items())

    def __repr__(self) -> str:
        return f"Owners({len(self.index)} boxes, {len(self.table)} workers)"


# ---- workers ------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class WorkerColumns:
    """The plan's workers as columns, in plan order."""

    ids: tuple[str, ...]
    floats: dict[str, np.ndarray]  # PROFILE_FLOATS -> float64
    ints: dict[str, np.ndarray]  # WORKER_INTS -> int64
    declared: np.ndarray  # bool

    @classmethod
    def of(cls, workers: Sequence[Any]) -> WorkerColumns:
        """From objects with `worker_id`, `cache_bytes` and a `profile` (PlanWorker)."""
        ps = [w.profile for w in workers]
        ids = tuple(w.worker_id for w in workers)
        if len(set(ids)) != len(ids):
            raise ValueError("a worker id appears twice in the plan")
        return cls(ids, {f: np.array([getattr(p, f) for p in ps], dtype=np.float64) for f in PROFILE_FLOATS},
                   {"memory_bytes": np.array([p.memory_bytes for p in ps], dtype=np.int64),
                    "cache_bytes": np.array([w.cache_bytes for w in workers], dtype=np.int64)},
                   np.array([p.declared for p in ps], dtype=bool))

    def __len__(self) -> int:
        return len(self.ids)

    def same(self, other: WorkerColumns) -> bool:
        return (self.ids == other.ids and bool(np.array_equal(self.declared, other.declared))
                and all(np.array_equal(self.floats[f], other.floats[f]) for f in PROFILE_FLOATS)
                and all(np.array_equal(self.ints[f], other.ints[f]) for f in WORKER_INTS))


def pack_workers(cols: WorkerColumns) -> dict[str, bytes]:
    doc = {"ids": "\n".join(cols.ids).encode("ascii")}
    doc.update({f: cols.floats[f].astype(_F64).tobytes() for f in PROFILE_FLOATS})
    doc.update({f: cols.ints[f].astype(_I64).tobytes() for f in WORKER_INTS})
    doc["declared"] = cols.declared.astype(_U8).tobytes()
    return doc


def unpack_workers(doc: Mapping[str, Any]) -> WorkerColumns:
    raw = doc.get("ids", b"")
    if not isinstance(raw, bytes):
        raise ValueError("workers.ids must be bytes")
    ids = tuple(raw.decode("latin-1").split("\n")) if raw else ()
    n = len(ids)
    if raw and (raw.translate(None, _ID_BYTES) != b"\n" * (n - 1) or min(map(len, ids)) < 1
                or max(map(len, ids)) > MAX_ID):
        raise ValueError(f"workers.ids must be newline-separated ids of 1-{MAX_ID} letters, digits, '_' or '-'")
    if n > MAX_PLAN_WORKERS:
        raise ValueError(f"{n} workers, over the limit of {MAX_PLAN_WORKERS}")
    if len(set(ids)) != n:
        raise ValueError("a worker id appears twice in the plan")
    floats = {f: _column(doc, f, _F64, n) for f in PROFILE_FLOATS}
    ints = {f: _column(doc, f, _I64, n) for f in WORKER_INTS}
    declared = _column(doc, "declared", _U8, n)
    for f, col in floats.items():
        low_ok = col >= 0 if f == "latency_s" else col > 0
        if not (np.isfinite(col) & low_ok).all():
            raise ValueError(f"workers.{f} holds a value that is not finite and {'>= 0' if f == 'latency_s' else '> 0'}")
    if n and (ints["memory_bytes"].min() <= 0 or ints["cache_bytes"].min() < 0):
        raise ValueError("workers.memory_bytes must be > 0 and workers.cache_bytes >= 0")
    if n and declared.max() > 1:
        raise ValueError("workers.declared must be 0 or 1")
    return WorkerColumns(ids, floats, ints, declared.astype(bool))


def _column(doc: Mapping[str, Any], name: str, dtype: np.dtype, n: int) -> np.ndarray:
    raw = doc.get(name)
    if not isinstance(raw, bytes) or len(raw) != n * dtype.itemsize:
        raise ValueError(f"workers.{name} must be {n * dtype.itemsize} bytes ({n} x {dtype.itemsize})")
    return np.frombuffer(raw, dtype=dtype)


class WorkerTable(Sequence[Any]):
    """`plan.workers`: a read-only sequence of PlanWorker, built from the columns on first use (`make`);
    `ids` and `columns` are there without building anything."""

    __slots__ = ("columns", "_make", "_items")

    def __init__(self, columns: WorkerColumns, make: Callable[[WorkerColumns, int], Any],
                 items: tuple[Any, ...] | None = None) -> None:
        self.columns, self._make, self._items = columns, make, items

    @property
    def ids(self) -> tuple[str, ...]:
        return self.columns.ids

    def items(self) -> tuple[Any, ...]:
        if self._items is None:
            self._items = tuple(self._make(self.columns, i) for i in range(len(self.columns)))
        return self._items

    def __len__(self) -> int:
        return len(self.columns)

    def __getitem__(self, i):
        return self.items()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WorkerTable):
            return self.columns.same(other.columns)
        return isinstance(other, Sequence) and self.items() == tuple(other)

    def __hash__(self) -> int:
        return hash(self.ids)

    def __repr__(self) -> str:
        return f"WorkerTable({len(self)} workers)"
