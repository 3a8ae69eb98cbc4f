"""Byte budgets by key (pure, but for the clock passed in): what a requester (a worker id) may draw of a
service's bytes, at most `burst` at once and `rate` per second after, as a token bucket. The scheduler's echoes
of the workers' link probes and the PS's answers to their model requests are drawn from such budgets.

Only the least recently used `max_keys` keys are remembered: a forgotten key's budget is full again, so a flood
of made-up keys costs at most `max_keys` entries of memory (and is bounded by a budget of all keys together,
where the caller keeps one: `refilled`).
"""

from __future__ import annotations

from collections import OrderedDict

MAX_KEYS = 100_000  # keys whose budget is remembered (the least recently seen are forgotten)


def refilled(bucket: tuple[float, float] | None, burst: float, rate: float, now: float) -> float:
    """The bytes a budget of `burst` refilled at `rate` holds at `now`, last left at (bytes, at) `bucket`
    (None: full)."""
    if bucket is None:
        return float(burst)
    left, at = bucket
    return min(float(burst), left + (now - at) * rate)


class Budgets:
    """One token bucket of bytes per key, each `burst` bytes at most, refilled at `rate` bytes a second."""

    def __init__(self, burst: float, rate: float, max_keys: int = MAX_KEYS) -> None:
        self.burst, self.rate, self.max_keys = burst, rate, max_keys
        self._left: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (bytes left, at)

    def wait(self, key: str, cost: float, now: float) -> float:
        """The seconds until `key`'s budget holds `cost` bytes (0.0: it does now). A cost over the burst never
        fits: callers cap a cost at the burst."""
        left = self._refresh(key, now)
        return (cost - left) / self.rate if cost > left else 0.0

    def take(self, key: str, cost: float, now: float) -> None:
        """Draw `cost` bytes of `key`'s budget (after `wait` said 0.0)."""
        self._left[key] = (self._refresh(key, now) - cost, now)

    def _refresh(self, key: str, now: float) -> float:
        left = refilled(self._left.pop(key, None), self.burst, self.rate, now)
        self._left[key] = (left, now)  # (the most recently seen, last)
        while len(self._left) > self.max_keys:
            self._left.popitem(last=False)
        return left
