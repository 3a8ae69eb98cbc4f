"""The simulated population: every device that ever takes part, its declared and actual profile, and when it
joins and leaves (a Poisson process of churn, drawn reproducibly from a seed).

Devices are numbered in the order they appear; the planner and the PS see the *declared* profiles (what a
device registered with), the simulated devices run at their *actual* ones. A straggler's compute and links
are scaled by STRAGGLER_SCALE (0.1, as in the published setting). By default it registers that way, as the
published cost models assume; a *hidden* straggler registers its full profile and runs slow, so only the
runtime's stealing and speculative copies can work around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from cleave.plan.fleet import (
    EDGE_DOWNLINK,
    EDGE_FLOPS,
    EDGE_LATENCY,
    EDGE_MEMORY,
    EDGE_UPLINK,
    Fleet,
    Profiles,
)

STRAGGLER_SCALE = 0.1  # a straggler's compute and links, relative to what it declared
SECONDS_PER_HOUR = 3600.0


@dataclass
class World:
    """Every simulated device, by number: ids, declared and actual profiles, join and leave times."""

    ids: list[str]
    declared: Profiles
    actual: Profiles
    join_at: np.ndarray
    leave_at: np.ndarray  # inf while a device stays
    straggler: np.ndarray  # bool
    churn_per_hour: float = 0.0  # leaves per device-hour; joins keep the expected size at the start's
    straggler_fraction: float = 0.0
    hidden_stragglers: bool = False
    synthetic: bool = True  # joiners drawn from the edge ranges (else resampled from the starting fleet)
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    churned_until: float = 0.0
    index: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        fleet: Fleet,
        *,
        stragglers: float = 0.0,
        hidden_stragglers: bool = False,
        churn_per_hour: float = 0.0,
        seed: int = 0,
        synthetic: bool = True,
    ) -> World:
        """The starting fleet (all present at time 0), with a `stragglers` fraction drawn at random."""
        rng = np.random.default_rng([seed, 7])
        n = len(fleet)
        full = Profiles.of_fleet(fleet)
        slow = np.zeros(n, dtype=bool)
        if stragglers > 0:
            slow[rng.choice(n, size=int(round(stragglers * n)), replace=False)] = True
        actual = full.scaled(slow, STRAGGLER_SCALE)
        world = cls(
            list(fleet.ids),
            full if hidden_stragglers else actual,
            actual,
            np.zeros(n),
            np.full(n, math.inf),
            slow,
            churn_per_hour,
            stragglers,
            hidden_stragglers,
            synthetic,
            rng,
        )
        world.index = {d: i for i, d in enumerate(world.ids)}
        return world

    def __len__(self) -> int:
        return len(self.ids)

    def fleet(self, members: np.ndarray) -> Fleet:
        """The planner's view (declared profiles) of these devices, in this order."""
        d = self.declared.take(members)
        return Fleet(
            tuple(self.ids[i] for i in members.tolist()), d.flops, d.mem.astype(np.int64), d.down, d.up, d.lat
        )

    def alive(self, t: float) -> np.ndarray:
        """Numbers of the devices present at time t."""
        return np.flatnonzero((self.join_at <= t) & (self.leave_at > t))

    def _draw(self) -> dict[str, float]:
        if self.synthetic:
            r = self.rng
            return {
                "flops": r.uniform(*EDGE_FLOPS),
                "down": r.uniform(*EDGE_DOWNLINK),
                "up": r.uniform(*EDGE_UPLINK),
                "lat": r.uniform(*EDGE_LATENCY),
                "mem": float(EDGE_MEMORY),
            }
        return self.declared.row(int(self.rng.integers(0, int(np.count_nonzero(self.join_at == 0)))))

    def _join(self, t: float) -> None:
        row = self._draw()
        slow = bool(self.rng.random() < self.straggler_fraction)
        self.ids.append(f"join-{len(self.ids):06d}")
        self.index[self.ids[-1]] = len(self.ids) - 1
        actual = {**row, **({c: row[c] * STRAGGLER_SCALE for c in ("flops", "down", "up")} if slow else {})}
        self.declared.append(row if self.hidden_stragglers else actual)
        self.actual.append(actual)
        self.join_at = np.append(self.join_at, t)
        self.leave_at = np.append(self.leave_at, math.inf)
        self.straggler = np.append(self.straggler, slow)

    def churn(self, until: float) -> None:
        """Draw leaves and joins up to `until`: leaves at `churn_per_hour` per present device, joins at the
        same rate times the starting fleet's size (so the expected size stays put)."""
        if self.churn_per_hour <= 0 or until <= self.churned_until:
            return
        rate = self.churn_per_hour / SECONDS_PER_HOUR
        base = int(np.count_nonzero(self.join_at == 0))
        t = self.churned_until
        while True:
            present = self.alive(t)
            total = rate * (len(present) + base)
            t += float(self.rng.exponential(1.0 / total))
            if t >= until:
                break
            if self.rng.random() < len(present) / (len(present) + base):
                self.leave_at[int(self.rng.choice(present))] = t
            else:
                self._join(t)
        self.churned_until = until
