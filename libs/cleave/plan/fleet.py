"""Device fleets as the planner sees them: ids plus profiles held as numpy arrays.

Three ways to get one: from `Device`s or a `{id: DeviceProfile}` mapping (the scheduler's registry), from a
JSON fleet file, or drawn from the edge profile the literature evaluates on (`synthetic_fleet`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from cleave.errors import ConfigError
from cleave.schemas import DeviceProfile

# The edge profile of the published evaluation (REFERENCES.md): devices drawn uniformly from these ranges.
EDGE_FLOPS = (5e12, 7e12)  # sustained GEMM FLOP/s
EDGE_UPLINK = (5e6, 10e6)  # bytes/s (MB = 1e6 bytes)
EDGE_DOWNLINK = (10e6, 100e6)  # bytes/s
EDGE_MEMORY = 512 * 1024**2  # bytes free for one tile's inputs and output (512 MiB)
# The papers set no latency. We draw 10-50 ms per tile (a round trip from a phone to a cloud PS over
# Wi-Fi or LTE), which makes latency matter: it is what leaves the slowest-to-reach devices out.
EDGE_LATENCY = (0.010, 0.050)  # seconds per tile
FLEET_FIELDS = ("flops", "memory_bytes", "downlink_bytes_per_s", "uplink_bytes_per_s", "latency_s")


@dataclass(frozen=True)
class Device:
    """One device the planner may use: its id and profile."""

    id: str
    profile: DeviceProfile


@dataclass(frozen=True, eq=False)
class Fleet:
    """A fleet as columns: `ids[i]` has `flops[i]`, `memory_bytes[i]`, ... (validated on construction)."""

    ids: tuple[str, ...]
    flops: np.ndarray  # FLOP/s
    memory_bytes: np.ndarray  # int64 bytes
    downlink: np.ndarray  # bytes/s, PS -> device
    uplink: np.ndarray  # bytes/s, device -> PS
    latency: np.ndarray  # seconds per tile

    def __post_init__(self) -> None:
        n = len(self.ids)
        if len(set(self.ids)) != n:
            dup = next(i for i in self.ids if self.ids.count(i) > 1)
            raise ConfigError(f"device id {dup!r} appears more than once in the fleet")
        for name in ("flops", "memory_bytes", "downlink", "uplink", "latency"):
            arr = getattr(self, name)
            if arr.shape != (n,):
                raise ConfigError(f"fleet column {name} has shape {arr.shape}, expected ({n},)")
            low = 0 if name == "latency" else 1e-300
            if not np.all(np.isfinite(arr)) or np.any(arr < low):
                raise ConfigError(f"fleet column {name} holds a value that is not finite and positive")

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def of(cls, devices: FleetLike) -> Fleet:
        """A Fleet from a Fleet (returned as is), `Device`s, or a `{id: DeviceProfile}` mapping."""
        if isinstance(devices, Fleet):
            return devices
        items = (
            list(devices.items()) if isinstance(devices, Mapping) else [(d.id, d.profile) for d in devices]
        )
        profiles = [p for _, p in items]
        return cls(
            ids=tuple(i for i, _ in items),
            flops=np.array([p.flops for p in profiles], dtype=np.float64),
            memory_bytes=np.array([p.memory_bytes for p in profiles], dtype=np.int64),
            downlink=np.array([p.downlink_bytes_per_s for p in profiles], dtype=np.float64),
            uplink=np.array([p.uplink_bytes_per_s for p in profiles], dtype=np.float64),
            latency=np.array([p.latency_s for p in profiles], dtype=np.float64),
        )

    def take(self, index: Sequence[int] | np.ndarray) -> Fleet:
        """The sub-fleet of the devices at these positions, in that order."""
        idx = np.asarray(index, dtype=np.int64)
        return Fleet(
            tuple(self.ids[i] for i in idx.tolist()),
            self.flops[idx],
            self.memory_bytes[idx],
            self.downlink[idx],
            self.uplink[idx],
            self.latency[idx],
        )

    def without(self, ids: Iterable[str]) -> Fleet:
        """The fleet less these devices (a leave); unknown ids are ignored."""
        gone = set(ids)
        return self.take([i for i, d in enumerate(self.ids) if d not in gone])

    def devices(self) -> list[Device]:
        """The fleet as `Device` objects (the registry's shape)."""
        return [
            Device(
                self.ids[i],
                DeviceProfile(
                    flops=float(self.flops[i]),
                    memory_bytes=int(self.memory_bytes[i]),
                    downlink_bytes_per_s=float(self.downlink[i]),
                    uplink_bytes_per_s=float(self.uplink[i]),
                    latency_s=float(self.latency[i]),
                ),
            )
            for i in range(len(self))
        ]

    def to_json_list(self) -> list[dict[str, str | float | int]]:
        """The fleet-file form: a list of `{"id", "flops", "memory_bytes", ...}`."""
        cols = (self.flops, self.memory_bytes, self.downlink, self.uplink, self.latency)
        return [
            {"id": self.ids[i], **{f: c[i].item() for f, c in zip(FLEET_FIELDS, cols, strict=True)}}
            for i in range(len(self))
        ]


FleetLike = Fleet | Sequence[Device] | Mapping[str, DeviceProfile]


MAX_SYNTHETIC = 1_000_000  # devices of a synthetic fleet: 100x the largest the planner is measured at (10,000)


def synthetic_fleet(n: int, seed: int = 0) -> Fleet:
    """`n` devices drawn uniformly from the edge profile (EDGE_* above); ids `dev-00000`, ... ."""
    if not 0 < n <= MAX_SYNTHETIC:
        raise ConfigError(f"a synthetic fleet has 1 to {MAX_SYNTHETIC:,} devices, got n={n:,}")
    rng = np.random.default_rng(seed)
    width = max(5, len(str(n - 1)))
    return Fleet(
        ids=tuple(f"dev-{i:0{width}d}" for i in range(n)),
        flops=rng.uniform(*EDGE_FLOPS, n),
        memory_bytes=np.full(n, EDGE_MEMORY, dtype=np.int64),
        downlink=rng.uniform(*EDGE_DOWNLINK, n),
        uplink=rng.uniform(*EDGE_UPLINK, n),
        latency=rng.uniform(*EDGE_LATENCY, n),
    )


def _entry(raw: object, pos: int, source: str) -> Device:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: entry {pos} is {type(raw).__name__}, expected an object")
    dev_id = raw.get("id")
    where = f"{source}: entry {pos} (id {dev_id!r})"
    if not isinstance(dev_id, str) or not dev_id:
        raise ConfigError(f"{where}: 'id' must be a non-empty string")
    missing = [f for f in FLEET_FIELDS if f not in raw]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}")
    flags = [f for f in FLEET_FIELDS if isinstance(raw[f], bool)]  # (pydantic reads true as 1, false as 0)
    if flags:
        raise ConfigError(f"{where}: {flags[0]}: expected a number (got {raw[flags[0]]!r})")
    try:
        return Device(dev_id, DeviceProfile.model_validate({f: raw[f] for f in FLEET_FIELDS}))
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"{where}: {field}: {err['msg']} (got {err.get('input')!r})") from None


def load_fleet(path: str | Path) -> Fleet:
    """Read a fleet file: a JSON array of `{"id", "flops", "memory_bytes", "downlink_bytes_per_s",
    "uplink_bytes_per_s", "latency_s"}`. Errors name the file and the bad entry."""
    source = str(path)
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read fleet file {source}: {e.strerror or e}") from None
    except ValueError as e:  # (malformed JSON, or bytes that are not UTF-8 text)
        raise ConfigError(f"{source}: not JSON: {e}") from None
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{source}: expected a non-empty JSON array of devices")
    devices = [_entry(item, i, source) for i, item in enumerate(raw)]
    seen: dict[str, int] = {}
    for i, d in enumerate(devices):
        if d.id in seen:
            raise ConfigError(f"{source}: entry {i} repeats id {d.id!r} of entry {seen[d.id]}")
        seen[d.id] = i
    return Fleet.of(devices)


def fleet_from_spec(spec: str, seed: int = 0) -> Fleet:
    """`synthetic:N` (the edge profile, drawn with `seed`) or the path of a fleet file."""
    if spec.startswith("synthetic:") or (spec == "synthetic" and not Path(spec).exists()):
        count = spec.removeprefix("synthetic").removeprefix(":")
        if not count.isdigit() or not 0 < int(count) <= MAX_SYNTHETIC:
            raise ConfigError(f"--fleet {spec!r}: expected synthetic:N with N from 1 to {MAX_SYNTHETIC:,}")
        return synthetic_fleet(int(count), seed)
    return load_fleet(spec)


COLUMNS = ("flops", "down", "up", "lat", "mem")


@dataclass
class Profiles:
    """Growable columns of device profiles (bytes/s, FLOP/s, seconds, bytes)."""

    flops: np.ndarray
    down: np.ndarray
    up: np.ndarray
    lat: np.ndarray
    mem: np.ndarray

    @classmethod
    def of_fleet(cls, fleet: Fleet) -> Profiles:
        return cls(
            fleet.flops.copy(),
            fleet.downlink.copy(),
            fleet.uplink.copy(),
            fleet.latency.copy(),
            fleet.memory_bytes.astype(np.float64),
        )

    def append(self, row: dict[str, float]) -> None:
        for c in COLUMNS:
            setattr(self, c, np.append(getattr(self, c), row[c]))

    def row(self, i: int) -> dict[str, float]:
        return {c: float(getattr(self, c)[i]) for c in COLUMNS}

    def take(self, idx: np.ndarray) -> Profiles:
        return Profiles(*(getattr(self, c)[idx] for c in COLUMNS))

    def scaled(self, mask: np.ndarray, scale: float) -> Profiles:
        """Compute and links multiplied by `scale` where `mask` (memory and latency unchanged)."""
        f = np.where(mask, scale, 1.0)
        return Profiles(self.flops * f, self.down * f, self.up * f, self.lat.copy(), self.mem.copy())
