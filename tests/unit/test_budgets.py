"""Byte budgets by key (`cleave.runtime.budgets`): a token bucket per key, the least recently used forgotten."""

from __future__ import annotations

import pytest

from cleave.runtime.budgets import Budgets, refilled


def test_a_key_draws_its_burst_then_its_rate() -> None:
    b = Budgets(burst=100, rate=10)
    assert b.wait("a", 100, now=0.0) == 0.0
    b.take("a", 100, now=0.0)
    assert b.wait("a", 30, now=1.0) == pytest.approx(2.0)  # 10 refilled, 20 more take 2 s
    assert b.wait("b", 100, now=1.0) == 0.0  # another key's budget is its own
    assert b.wait("a", 30, now=3.0) == 0.0
    assert b.wait("a", 1000, now=100.0) == pytest.approx(90.0)  # refilled to the burst, never past it
    assert refilled((5.0, 0.0), burst=100, rate=10, now=2.0) == 25.0 and refilled(None, 100, 10, 0.0) == 100.0


def test_only_the_most_recently_seen_keys_are_remembered() -> None:
    b = Budgets(burst=100, rate=1, max_keys=2)
    for key in ("a", "b"):
        b.take(key, 100, now=0.0)
    b.wait("a", 1, now=0.0)  # seen again: "b" is now the oldest
    b.take("c", 100, now=0.0)  # a third key: "b" is forgotten, full again
    assert b.wait("a", 100, now=0.0) > 0 and b.wait("b", 100, now=0.0) == 0.0
