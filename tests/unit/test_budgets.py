"""Byte budgets by key (`cleave.runtime.budgets`): a token bucket per key, the least recently used forgotten;
the PS's answers to model requests drawn from them."""

from __future__ import annotations

import pytest

from cleave.models.bundles import Shelf, describe_file
from cleave.runtime.budgets import Budgets, refilled
from cleave.schemas import ModelsGet


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


async def test_a_part_larger_than_a_workers_whole_budget_takes_all_of_it(tmp_path) -> None:
    """The PS's answers to model requests (`Shelf.answer`): a part over the budget's burst is not refused for
    ever; it is sent once the budget is full, and empties it."""
    path = tmp_path / "weights"
    path.write_bytes(bytes(range(256)) * 20)
    sha = describe_file(path).sha256
    shelf = Shelf(copies=0, min_burst=1000, refill_s=1.0)  # 1,000 bytes, refilled in 1 s
    shelf.files[sha] = (path, 5120)
    ask = ModelsGet(kind="file", sha256=sha, length=4096, waits=True)
    first = await shelf.answer(1 << 20, ask, "cleave.models.w1")
    assert first.data == path.read_bytes()[:4096] and first.retry_after_s == 0
    again = await shelf.answer(1 << 20, ask, "cleave.models.w1")
    assert not again.data and 0.9 < again.retry_after_s <= 1.0, again
    assert (await shelf.answer(1 << 20, ask, "cleave.models.w2")).data  # another worker's budget
