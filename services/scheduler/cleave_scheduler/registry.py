"""The device registry's pure core: who is alive, with what profile, and when membership changed.

A profile is what its worker claims; the PS reports what each worker delivers (`Observed`). A worker that
delivered `OVERCLAIM` times slower than its claimed profile predicts (allowing `TILE_OVERHEAD_S` a tile for
what the cost model leaves out: the PS's dealing, the bus) is planned, from then on, with its claimed rates
divided by that factor (its latency and memory as claimed); the factor moves again only when what it delivers
moves by more than `HYSTERESIS` (so plans do not follow every report), and goes once it delivers within
`RECOVERED` of its claim (`corrections`). A device whose profile broke the planner is dropped (`refuse`): its
heartbeats are ignored until its profile changes. Heartbeats under one id that keep switching between two
processes (their `started_at`) are two machines sharing a credential or `--worker-id` (`shared`): said, since
neither can be told apart from the other by the PS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cleave.plan.profile import liveness_limit
from cleave.schemas import DeviceProfile, DeviceRecord, Heartbeat, Observed, Plan, PlanWorker

OVERCLAIM = 8.0  # a worker delivering this many times slower than its profile predicts is corrected ...
HYSTERESIS = 2.0  # ... then again only when that changes by more than this factor ...
RECOVERED = 2.0  # ... until it delivers within this factor of its claim again
TILE_OVERHEAD_S = 0.02  # a tile's cost beyond the cost model, allowed before comparing (measured: ~0.01-0.07 s a
# tile of the tiny model on a loaded 2-core machine, where the cost model predicts a few ms)
DEFAULT_LINK_GRACE_S = 5.0  # at most this much liveness a worker's claimed link adds (`liveness_limit`)
SHARED_SWITCHES = 3  # heartbeats of one id switching process this often within SHARED_WINDOW liveness periods:
SHARED_WINDOW = 5    # two processes share the id (a restart switches once)


def scaled(p: DeviceProfile, factor: float) -> DeviceProfile:
    """`p` with its FLOPS and bandwidths divided by `factor` (kept within a profile's range)."""
    return DeviceProfile.within(flops=p.flops / factor, memory_bytes=p.memory_bytes, latency_s=p.latency_s,
                                downlink_bytes_per_s=p.downlink_bytes_per_s / factor,
                                uplink_bytes_per_s=p.uplink_bytes_per_s / factor, declared=p.declared)


@dataclass
class Registry:
    liveness_s: float
    devices: dict[str, DeviceRecord] = field(default_factory=dict)
    version: int = 0
    link_grace_s: float = DEFAULT_LINK_GRACE_S
    claimed: dict[str, DeviceProfile] = field(default_factory=dict)  # worker -> the profile it claims
    corrections: dict[str, float] = field(default_factory=dict)  # worker -> its claim's rates over what it delivers
    refused: dict[str, DeviceProfile] = field(default_factory=dict)  # worker -> a profile that broke the planner
    started: dict[str, float] = field(default_factory=dict)  # worker -> the started_at of its last heartbeat
    switches: dict[str, list[float]] = field(default_factory=dict)  # worker -> when its heartbeats changed process

    def heartbeat(self, hb: Heartbeat, now: float) -> bool | None:
        """Record a heartbeat; True when this worker is new (membership changed), None when it is refused."""
        w = hb.worker_id
        if self.refused.get(w) == hb.profile:
            return None
        self.refused.pop(w, None)
        old = self.devices.get(w)
        self.claimed[w] = hb.profile
        factor = self.corrections.get(w, 1.0)
        profile = hb.profile if factor == 1.0 else scaled(hb.profile, factor)
        self.devices[w] = DeviceRecord(
            worker_id=w, profile=profile, first_seen=old.first_seen if old else now,
            last_seen=now, cache_bytes=hb.cache_bytes, tiles_done=hb.tiles_done,
        )
        return old is None

    def shared(self, hb: Heartbeat, now: float) -> tuple[float, float] | None:
        """The two processes' `started_at` when heartbeats under `hb.worker_id` keep switching between processes
        (SHARED_SWITCHES times within SHARED_WINDOW liveness periods); None otherwise, a restart included."""
        w, before = hb.worker_id, self.started.get(hb.worker_id)
        self.started[w] = hb.started_at
        if before is None or before == hb.started_at:
            return None
        window = SHARED_WINDOW * self.liveness_s
        recent = [t for t in self.switches.get(w, ()) if now - t < window] + [now]
        self.switches[w] = recent
        return (min(before, hb.started_at), max(before, hb.started_at)) if len(recent) >= SHARED_SWITCHES else None

    def observe(self, report: Observed) -> list[tuple[str, float, float]]:
        """Apply what the PS saw the workers deliver; (worker, old factor, new factor) of each correction."""
        changed = []
        for o in report.workers:
            claim, rec = self.claimed.get(o.worker_id), self.devices.get(o.worker_id)
            if claim is None or rec is None:
                continue
            # how many times slower than its claim it delivered (the PS predicted on the profile it was planned with)
            allowed = o.predicted_s + o.tiles * TILE_OVERHEAD_S
            slower = (o.observed_s / allowed) * (claim.flops / o.flops)
            old = self.corrections.get(o.worker_id, 1.0)
            if old == 1.0:
                new = slower if slower >= OVERCLAIM else 1.0
            elif slower < RECOVERED:
                new = 1.0
            elif not old / HYSTERESIS <= slower <= old * HYSTERESIS:
                new = slower
            else:
                new = old
            if new == old:
                continue
            if new == 1.0:
                del self.corrections[o.worker_id]
            else:
                self.corrections[o.worker_id] = new
            self.devices[o.worker_id] = rec.model_copy(update={"profile": claim if new == 1.0 else scaled(claim, new)})
            changed.append((o.worker_id, old, new))
        return changed

    def refuse(self, worker: str, reason: str) -> DeviceRecord | None:
        """Drop `worker` until its profile changes (its profile broke the planner: `reason`)."""
        rec = self.devices.pop(worker, None)
        if worker in self.claimed:
            self.refused[worker] = self.claimed.pop(worker)
        self.corrections.pop(worker, None)
        return rec

    def refresh(self, now: float) -> None:
        """Treat every known device as just seen (after the scheduler itself was cut off)."""
        self.devices = {w: d.model_copy(update={"last_seen": now}) for w, d in self.devices.items()}

    def limit_s(self, d: DeviceRecord) -> float:
        """How long `d` may stay silent: the liveness period plus what its link adds, at most `link_grace_s`."""
        return min(liveness_limit(self.liveness_s, d.profile), self.liveness_s + self.link_grace_s)

    def sweep(self, now: float) -> list[str]:
        """Forget workers whose heartbeats stopped (for longer than their link's liveness limit); their ids."""
        gone = [w for w, d in self.devices.items() if now - d.last_seen > self.limit_s(d)]
        for w in gone:
            del self.devices[w]
            self.claimed.pop(w, None)
            self.started.pop(w, None)
            self.switches.pop(w, None)
        return gone

    def plan(self, now: float, tile_rows: int, tile_cols: int, reason: str, chunks: int = 1,
             without: frozenset[str] = frozenset()) -> Plan:
        """The first, uniform plan: every live worker (but those `without`) takes part, tiles of one shape
        dealt from a queue."""
        self.version += 1
        workers = tuple(
            PlanWorker(worker_id=d.worker_id, profile=d.profile, cache_bytes=d.cache_bytes)
            for d in sorted(self.devices.values(), key=lambda d: d.worker_id) if d.worker_id not in without
        )
        return Plan(version=self.version, created_at=now, workers=workers, tile_rows=tile_rows,
                    tile_cols=tile_cols, chunks=chunks, reason=reason)
