"""The device registry's pure core: who is alive, with what profile, and when membership changed."""

from __future__ import annotations

from dataclasses import dataclass, field

from cleave.plan.profile import liveness_limit
from cleave.schemas import DeviceRecord, Heartbeat, Plan, PlanWorker


@dataclass
class Registry:
    liveness_s: float
    devices: dict[str, DeviceRecord] = field(default_factory=dict)
    version: int = 0

    def heartbeat(self, hb: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True when this worker is new (membership changed)."""
        old = self.devices.get(hb.worker_id)
        self.devices[hb.worker_id] = DeviceRecord(
            worker_id=hb.worker_id, profile=hb.profile, first_seen=old.first_seen if old else now,
            last_seen=now, cache_bytes=hb.cache_bytes, tiles_done=hb.tiles_done,
        )
        return old is None

    def refresh(self, now: float) -> None:
        """Treat every known device as just seen (after the scheduler itself was cut off)."""
        self.devices = {w: d.model_copy(update={"last_seen": now}) for w, d in self.devices.items()}

    def sweep(self, now: float) -> list[str]:
        """Forget workers whose heartbeats stopped (for longer than their link's liveness limit); their ids."""
        gone = [w for w, d in self.devices.items() if now - d.last_seen > liveness_limit(self.liveness_s, d.profile)]
        for w in gone:
            del self.devices[w]
        return gone

    def plan(self, now: float, tile_rows: int, tile_cols: int, reason: str, chunks: int = 1) -> Plan:
        """The first, uniform plan: every live worker takes part, tiles of one shape dealt from a queue."""
        self.version += 1
        workers = tuple(
            PlanWorker(worker_id=d.worker_id, profile=d.profile, cache_bytes=d.cache_bytes)
            for d in sorted(self.devices.values(), key=lambda d: d.worker_id)
        )
        return Plan(version=self.version, created_at=now, workers=workers, tile_rows=tile_rows,
                    tile_cols=tile_cols, chunks=chunks, reason=reason)
