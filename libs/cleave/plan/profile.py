"""Device profiles: parse a declared one, and pace a worker so that it behaves like it.

A declared profile lets one machine emulate a heterogeneous edge fleet: the worker delays each result
until the device it pretends to be would have finished the tile. The device streams (`streamed`): its
downlink, compute and uplink work in parallel on consecutive tiles, so a long run of tiles costs the cost
model of DESIGN.md 5, latency + max(bytes down / downlink, bytes up / uplink, FLOPs / FLOPS), plus one
tile's other stages; a single tile costs the sum of its stages. `dealt_time` is that clock for tiles dealt
a few at a time, which is how the scheduler predicts what a plan's blocks will take at run time.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError

from cleave.errors import ConfigError
from cleave.schemas import DeviceProfile

UNITS = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30}
KEYS = {"flops": "flops", "down": "downlink_bytes_per_s", "up": "uplink_bytes_per_s", "latency": "latency_s",
        "memory": "memory_bytes"}


def _number(text: str) -> float:
    t = text.strip().lower()
    for suffix in sorted(UNITS, key=len, reverse=True):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * UNITS[suffix]
    return float(t)


def parse_profile(spec: str) -> DeviceProfile:
    """'flops=5e12,down=50M,up=8M,latency=0.02,memory=512Mi' -> DeviceProfile (all five keys required)."""
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in KEYS:
            raise ConfigError(f"profile entry {part!r}: expected one of {', '.join(f'{k}=' for k in KEYS)}")
        if KEYS[key.strip()] in values:
            raise ConfigError(f"profile {spec!r}: {key.strip()}= is given twice")
        try:
            values[KEYS[key.strip()]] = _number(value)
        except ValueError:
            raise ConfigError(f"profile entry {part!r}: {value!r} is not a number (suffixes k, M, G, T, Ki, Mi, Gi)") from None
    missing = [k for k, v in KEYS.items() if v not in values]
    if missing:
        raise ConfigError(f"profile {spec!r} lacks {', '.join(missing)}")
    values["memory_bytes"] = int(values["memory_bytes"])
    try:
        return DeviceProfile(**values, declared=True)
    except ValidationError as e:  # the first of what is wrong, on one line, by the profile's own key
        first = e.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        key = next((k for k, v in KEYS.items() if v == field), field)
        raise ConfigError(f"profile {spec!r}: {key}= {first['msg'].removeprefix('Value error, ')}") from None


Clock = tuple[float, float, float]  # when a device's downlink, compute and uplink are next free


def block_seconds(p: DeviceProfile, bytes_down: float, bytes_up: float, flops: float) -> float:
    """The cost model's time of one block alone on device `p`: its latency, then the longest of its
    download, its upload and its compute (they overlap)."""
    return p.latency_s + max(bytes_down / p.downlink_bytes_per_s, bytes_up / p.uplink_bytes_per_s, flops / p.flops)


def tile_seconds(p: DeviceProfile, rows: int, cols: int, k: int, b: int) -> float:
    """One rows x cols tile of a GEMM with inner dimension k (b bytes an element) on device `p`."""
    return block_seconds(p, (rows + cols) * k * b, rows * cols * b, 2.0 * rows * cols * k)


def streamed(free: Clock, arrived: float, latency_s: float, down_s: float, compute_s: float, up_s: float) -> Clock:
    """A device's clock after one more tile that reaches it at `arrived` (+ latency): it downloads once its
    downlink is free, computes once downloaded and the compute is free, uploads once computed and the uplink
    is free. The last entry is when its result has left."""
    down = max(arrived + latency_s, free[0]) + down_s
    compute = max(down, free[1]) + compute_s
    return down, compute, max(compute, free[2]) + up_s


def dealt_time(p: DeviceProfile, tiles: Sequence[tuple[float, float, float]], in_flight: int) -> float:
    """Seconds from dealing until the last result, for `tiles` (bytes down, bytes up, FLOPs) dealt
    `in_flight` at a time, the next sent as a result comes back, on a device that streams as `Pacer`."""
    clock, done = (0.0, 0.0, 0.0), []
    for i, (down, up, flops) in enumerate(tiles):
        sent = done[i - in_flight] if i >= in_flight else 0.0
        clock = streamed(clock, sent, p.latency_s, down / p.downlink_bytes_per_s, flops / p.flops,
                         up / p.uplink_bytes_per_s)
        done.append(clock[2])
    return done[-1] if done else 0.0


class Pacer:
    """When a declared device would have finished each tile (wall-clock seconds).

    The device streams: its downlink, its compute and its uplink are three resources that work in
    parallel on consecutive tiles (tile i computes while tile i+1 arrives and tile i-1 leaves), so a long
    run of tiles costs max(bytes down / downlink, FLOPs / FLOPS, bytes up / uplink) plus one tile's other
    stages, as the planner's overlapped cost model assumes. Latency delays each tile once, on arrival.
    """

    def __init__(self, profile: DeviceProfile) -> None:
        self.p = profile
        self.down_free = self.compute_free = self.up_free = 0.0

    def tile_time(self, bytes_down: int, bytes_up: int, flops: float) -> float:
        """The cost model of one block on its own."""
        return block_seconds(self.p, bytes_down, bytes_up, flops)

    def finish_at(self, arrived: float, bytes_down: int, bytes_up: int, flops: float) -> float:
        p = self.p
        self.down_free, self.compute_free, self.up_free = streamed(
            (self.down_free, self.compute_free, self.up_free), arrived, p.latency_s,
            bytes_down / p.downlink_bytes_per_s, flops / p.flops, bytes_up / p.uplink_bytes_per_s,
        )
        return self.up_free


HEARTBEAT_QUEUE_BYTES = 64 * 1024  # bulk bytes a heartbeat may find queued ahead of it at its uplink's bottleneck


def liveness_limit(base_s: float, p: DeviceProfile) -> float:
    """How long a worker may stay silent before it counts as gone: `base_s`, plus what its own link adds to
    a heartbeat's trip (a round trip, and a queue of HEARTBEAT_QUEUE_BYTES on its uplink ahead of it).
    Heartbeats travel on their own connection, so no probe or result is ever ahead of them on the
    worker's side; 5 MB/s up adds 13 ms, 0.4 MB/s 0.16 s, and a worker that vanished is still lost
    after about `base_s`."""
    return base_s + 2 * p.latency_s + HEARTBEAT_QUEUE_BYTES / p.uplink_bytes_per_s
