"""The fleet split among PS replicas (cleave.plan.partition) and the scheduler's per-replica plans."""

from __future__ import annotations

import pytest

from cleave.models import gemm_shapes, get_preset
from cleave.plan import partition
from cleave.schemas import DeviceProfile, GemmSpec, JobShapes, Plan, PlanWorker
from cleave_scheduler.replicas import ReplicaPlans


def profile(flops: float = 1e10, down: float = 1e8, up: float = 1e8, lat: float = 1e-3) -> DeviceProfile:
    return DeviceProfile(flops=flops, memory_bytes=1 << 30, downlink_bytes_per_s=down, uplink_bytes_per_s=up,
                         latency_s=lat)


def plan_of(profiles: dict[str, DeviceProfile], version: int = 1) -> Plan:
    workers = tuple(PlanWorker(worker_id=w, profile=p) for w, p in sorted(profiles.items()))
    return Plan(version=version, created_at=0.0, workers=workers, tile_rows=128, tile_cols=128, reason="join")


def shapes(replicas: int = 2) -> JobShapes:
    specs = tuple(GemmSpec(name=g.name, m=g.m, n=g.n, k=g.k, count_per_step=g.count_per_step)
                  for g in gemm_shapes(get_preset("tiny"), 4, 64))
    return JobShapes(job="j", gemms=specs, replicas=replicas)


def loads(rates: dict[str, float], assignment: dict[str, int], replicas: int) -> list[float]:
    out = [0.0] * replicas
    for w, r in assignment.items():
        out[r] += rates[w]
    return out


def test_device_rate_follows_the_cost_model():
    g = [GemmSpec(name="x", m=256, n=256, k=64)]
    fast, slow_link = partition.device_rate(profile(), g, 4, 128, 128), partition.device_rate(profile(down=1e6), g, 4, 128, 128)
    assert fast > 10 * slow_link  # a device starved by its downlink is worth less, whatever its FLOPS
    # 4 tiles of 128 x 128 x 64: latency + the largest of down, up and compute, each
    one = 1e-3 + max(256 * 64 * 4 / 1e8, 128 * 128 * 4 / 1e8, 2 * 128 * 128 * 64 / 1e10)
    assert fast == pytest.approx(1 / (4 * one))


def test_partition_balances_summed_rates():
    rates = {"a": 8.0, "b": 4.0, "c": 4.0, "d": 2.0, "e": 1.0, "f": 1.0}
    got = partition.partition(rates, 2)
    assert sorted(loads(rates, got, 2)) == [10.0, 10.0]
    assert set(got) == set(rates) and set(got.values()) == {0, 1}
    assert partition.partition(rates, 2) == got  # deterministic


def test_partition_is_sticky_on_churn_until_unbalanced():
    rates = {f"w{i}": 1.0 for i in range(6)}
    first = partition.partition(rates, 2)
    joined = partition.partition({**rates, "new": 1.0}, 2, first)
    assert all(joined[w] == first[w] for w in first)  # nobody moves when one joins
    one_left = dict(rates)
    del one_left[next(w for w in sorted(rates) if first[w] == 1)]
    after = partition.partition(one_left, 2, first)
    assert after == {w: first[w] for w in one_left}  # 3 against 2: within the imbalance allowed, nobody moves
    two_left = {w: 1.0 for w in rates if first[w] == 0} | {next(w for w in sorted(rates) if first[w] == 1): 1.0}
    redealt = partition.partition(two_left, 2, first)
    assert sorted(loads(two_left, redealt, 2)) == [2.0, 2.0]  # 3 against 1 is past it: dealt afresh


def test_partition_never_leaves_a_replica_empty_while_another_has_two():
    first = partition.partition({"a": 1.0, "b": 1.0}, 2)
    gone = {w: 1.0 for w in ("c", "d")} | {w: 1.0 for w, r in first.items() if r == 0}
    got = partition.partition(gone, 2, first)
    assert set(got.values()) == {0, 1}


def test_replica_plans_split_the_fleet_disjointly():
    fleet = {f"w{i}": profile(flops=1e9 * (i + 1)) for i in range(5)}
    parts = ReplicaPlans().split(plan_of(fleet), shapes(2))
    ids = [set(p.workers.ids) for p in parts]
    assert len(parts) == 2 and ids[0].isdisjoint(ids[1]) and ids[0] | ids[1] == set(fleet)
    assert all(p.version == 1 and p.tile_rows == 128 for p in parts)
    assert ReplicaPlans().split(plan_of(fleet), shapes(1)) == []  # one PS: the fleet's plan as before


def test_shares_are_equal_or_refused():
    assert partition.shares(8, 2) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="evenly"):
        partition.shares(8, 3)
