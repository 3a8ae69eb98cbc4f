"""The planner: exact tilings, memory budgets, optimality against an exact MILP and the lower bound, scale,
selection of devices, errors, the even-split baseline, re-planning and the `cleave plan` command."""

from __future__ import annotations

import argparse
import io
import json

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix

from cleave.errors import ConfigError, PlanError
from cleave.models import gemm_shapes, get_preset
from cleave.plan.costmodel import Rates
from cleave.plan.fleet import Fleet, load_fleet, synthetic_fleet
from cleave.plan.planner import GemmPlan, even_split, plan_gemm, plan_model
from cleave_cli.plan_cmd import plan_command, register


def random_fleet(rng: np.random.Generator, n: int, k: int, b: int, mem_factor: float = 1000.0) -> Fleet:
    """Heterogeneous devices whose transfer times are comparable to their latency at small shapes."""
    floor = (2 * k + 1) * b  # a 1x1 tile
    return Fleet(
        ids=tuple(f"d{i}" for i in range(n)),
        flops=rng.uniform(1e9, 1e11, n),
        memory_bytes=rng.integers(floor, int(floor * mem_factor) + 1, n).astype(np.int64),
        downlink=rng.uniform(1e6, 5e7, n),
        uplink=rng.uniform(2e5, 5e6, n),
        latency=rng.uniform(0, 0.01, n),
    )


def expected_device_times(plan: GemmPlan, fleet: Fleet) -> np.ndarray:
    """The cost model written out again, independently of cleave.plan.costmodel."""
    r = (plan.row1 - plan.row0).astype(float)
    c = (plan.col1 - plan.col0).astype(float)
    k, b, d = plan.k, plan.dtype_bytes, plan.dev
    t = fleet.latency[d] + np.maximum.reduce(
        [(r + c) * k * b / fleet.downlink[d], r * c * b / fleet.uplink[d], 2 * r * c * k / fleet.flops[d]]
    )
    return np.bincount(d, weights=t, minlength=len(fleet))


def assert_valid(plan: GemmPlan, fleet: Fleet) -> None:
    """Blocks tile [0, m) x [0, n) exactly, fit their device's memory, and the costs add up."""
    m, n, k, b = plan.m, plan.n, plan.k, plan.dtype_bytes
    assert np.all((plan.row0 >= 0) & (plan.row0 < plan.row1) & (plan.row1 <= m))
    assert np.all((plan.col0 >= 0) & (plan.col0 < plan.col1) & (plan.col1 <= n))
    assert int(((plan.row1 - plan.row0) * (plan.col1 - plan.col0)).sum()) == m * n
    # Count how often each cell of the grid spanned by all block edges is covered (a 2-D difference array
    # on compressed coordinates): exactly once everywhere means no gap and no overlap.
    rs, cs = np.unique(np.r_[plan.row0, plan.row1, 0, m]), np.unique(np.r_[plan.col0, plan.col1, 0, n])
    r0, r1 = np.searchsorted(rs, plan.row0), np.searchsorted(rs, plan.row1)
    c0, c1 = np.searchsorted(cs, plan.col0), np.searchsorted(cs, plan.col1)
    cover = np.zeros((len(rs), len(cs)), dtype=np.int32)
    for rr, cc, sign in ((r0, c0, 1), (r0, c1, -1), (r1, c0, -1), (r1, c1, 1)):
        np.add.at(cover, (rr, cc), sign)
    assert np.all(cover.cumsum(0).cumsum(1)[:-1, :-1] == 1), "blocks overlap or leave a gap"
    rows, cols = (plan.row1 - plan.row0).astype(np.int64), (plan.col1 - plan.col0).astype(np.int64)
    assert np.all(((rows + cols) * k + rows * cols) * b <= fleet.memory_bytes[plan.dev])
    times = expected_device_times(plan, fleet)
    assert plan.device_time_s == pytest.approx(times.max(), rel=1e-9)
    assert plan.makespan_s >= plan.lower_bound_s * (1 - 1e-9)
    assert [a.device for a in plan.assignments] == [fleet.ids[d] for d in plan.dev]


def test_tiles_exactly_for_random_fleets_and_shapes():
    for seed in range(40):
        rng = np.random.default_rng(seed)
        n_dev = int(rng.choice([1, 2, 3, 7, 16, 41, 120, 600]))
        m, n = (int(x) for x in rng.integers(1, 300, 2))
        k, b = int(rng.integers(1, 3000)), int(rng.choice([2, 4]))
        fleet = random_fleet(rng, n_dev, k, b, mem_factor=float(rng.choice([20, 1000])))
        plan = plan_gemm(fleet, m, n, k, b, name=f"seed{seed}")
        assert_valid(plan, fleet)


def test_memory_budget_forces_several_tiles_and_holds():
    rng = np.random.default_rng(7)
    k, b = 2048, 2
    fleet = random_fleet(rng, 5, k, b, mem_factor=40)  # tiles of at most ~40x40: 30 000 outputs need many
    plan = plan_gemm(fleet, 300, 100, k, b)
    assert_valid(plan, fleet)
    assert np.bincount(plan.dev).max() > 1, "memory should force several tiles onto some device"
    big = synthetic_fleet(4, seed=1)  # 512 MiB devices, llama3-1b's lm_head at batch 128 (k = 131072 for dW)
    plan = plan_gemm(big, 2048, 2048, 131_072, 2)
    assert_valid(plan, big)
    assert len(plan.dev) > len(big)

    # OPT's lm_head dW on 32 edge devices: a strip along the 1,024 side fits no device's memory, so only
    # the other orientation has a plan (this used to raise instead of taking it)
    edge = synthetic_fleet(32, seed=0)
    plan = plan_gemm(edge, 131_072, 1024, 50_272, 2)
    assert_valid(plan, edge)
    assert plan.gap < 0.1


# The published formulation (REFERENCES.md), with our memory and latency terms: integer rows a_i and
# columns b_i per device and a "used" flag; minimise T subject to every used device finishing its a_i x b_i
# block within T and sum_i a_i·b_i >= m·n. It counts area only (no tiling constraint), but gives each device
# one block: its optimum is a lower bound on every exact tiling that does the same. The planner may also give
# a device several blocks in turn, each within its memory, which the formulation cannot express: where it
# does, it can beat the MILP (benchmarks/planner_milp.py). The product a_i·b_i is linearised by one-hot rows:
# u[i,a] = 1 iff a_i = a, and v[i,a] = b_i·u[i,a] (integer), so a_i·b_i = sum_a a·v[i,a].
def area_milp_optimum(fleet: Fleet, m: int, n: int, k: int, b: int) -> float:
    r = Rates.of(fleet, k, b)
    lo, hi = min(m, n), max(m, n)
    nd, na = len(fleet), lo + 1
    nu = nd * na
    t = 2 * nu  # index of T (in ms, to keep the coefficients near 1)
    a_mat = lil_matrix((nd * (2 * na + 4) + 1, t + 1))
    lb, ub, row = [], [], 0

    def add(coeffs: dict[int, float], low: float, high: float) -> None:
        nonlocal row
        for col, val in coeffs.items():
            a_mat[row, col] = val
        lb.append(low)
        ub.append(high)
        row += 1

    for i in range(nd):
        u = [i * na + a for a in range(na)]
        v = [nu + i * na + a for a in range(na)]
        add({u[a]: 1 for a in range(na)}, 1, 1)  # exactly one row count, 0 = unused
        for a in range(na):
            add({v[a]: 1, u[a]: -hi}, -np.inf, 0)  # v = 0 unless a_i = a
            add({v[a]: -1, u[a]: 1 if a else 0}, -np.inf, 0)  # a used device has a column
        down = {u[a]: 1e3 * (r.lat[i] + a / r.lines[i]) for a in range(1, na)} | {
            x: 1e3 / r.lines[i] for x in v
        }
        add(down | {t: -1}, -np.inf, 0)  # latency + (a_i + b_i)·k·b / downlink <= T
        up = {u[a]: 1e3 * r.lat[i] for a in range(1, na)} | {v[a]: 1e3 * a / r.area[i] for a in range(na)}
        add(up | {t: -1}, -np.inf, 0)  # latency + a_i·b_i / min(uplink / b, flops / 2k) <= T
        add({u[a]: a * k for a in range(na)} | {v[a]: k + a for a in range(na)}, -np.inf, float(r.mem[i]))
    add({nu + i * na + a: a for i in range(nd) for a in range(1, na)}, m * n, np.inf)  # area covered
    cost = np.zeros(t + 1)
    cost[t] = 1
    upper = np.ones(t + 1)
    upper[nu:t], upper[t] = hi, np.inf
    res = milp(
        cost,
        constraints=LinearConstraint(a_mat.tocsr()[:row], lb, ub),
        integrality=np.r_[np.ones(t), 0],
        bounds=Bounds(np.zeros(t + 1), upper),
        options={"mip_rel_gap": 1e-7, "time_limit": 60},
    )
    assert res.status == 0, res.message
    return res.fun / 1e3


def milp_instance(seed: int) -> tuple[Fleet, int, int, int]:
    """The random instances the planner is checked against the MILP on: up to 16 devices, small shapes."""
    rng = np.random.default_rng(seed)
    n_dev, m, n, k = int(rng.integers(2, 17)), int(rng.integers(2, 6)), int(rng.integers(6, 48)), 1024
    return random_fleet(rng, n_dev, k, 2, mem_factor=60), m, n, k


@pytest.mark.parametrize("seed", range(40))
def test_within_5_percent_of_the_exact_milp(seed):
    fleet, m, n, k = milp_instance(seed)
    opt = area_milp_optimum(fleet, m, n, k, 2)
    plan = plan_gemm(fleet, m, n, k, 2)
    assert_valid(plan, fleet)
    assert plan.makespan_s <= 1.05 * opt
    if np.bincount(plan.dev).max() == 1:  # one block per device, as the MILP: no such plan can beat it
        assert plan.makespan_s >= opt * (1 - 1e-6)
        assert plan.lower_bound_s <= opt * (1 + 1e-6)  # our relaxation is a valid bound, as tight as the MILP


def test_ten_thousand_devices_whole_model_under_a_second_within_two_percent():
    fleet = synthetic_fleet(10_000, seed=0)
    for preset, batch in (("llama3-1b", 8), ("gpt2-medium", 128)):
        shapes = gemm_shapes(get_preset(preset), batch, 1024)
        plan = min((plan_model(fleet, shapes, 2) for _ in range(2)), key=lambda p: p.plan_cpu_s)
        # CPU seconds of this process: other processes on the shared 2 cores inflate the wall clock
        assert plan.plan_cpu_s < 1.0, f"{preset}: planning took {plan.plan_cpu_s:.2f} s of CPU"
        worst = max(plan.gemms, key=lambda g: g.gap)
        assert worst.gap < 0.02, f"{preset} {worst.name}: {worst.gap:.2%} above the lower bound"
        assert plan.predicted_step_s == pytest.approx(
            sum(g.makespan_s * g.count_per_step for g in plan.gemms)
        )
        assert_valid(plan.gemms[0], fleet)


def test_leaves_out_devices_that_would_slow_the_step():
    rng = np.random.default_rng(3)
    good = random_fleet(rng, 12, 512, 2)
    slow = Fleet(  # a slow link, a far-away device, and one without memory for even a 1x1 tile
        ("slow-link", "far-away", "no-memory"),
        np.array([1e11, 1e11, 1e11]),
        np.array([10**9, 10**9, 1000]),
        np.array([1e3, 5e7, 5e7]),
        np.array([1e3, 5e6, 5e6]),
        np.array([0.0, 5.0, 0.0]),
    )
    both = Fleet.of([*good.devices(), *slow.devices()])
    plan = plan_gemm(both, 64, 96, 512, 2)
    assert_valid(plan, both)
    used = {a.device for a in plan.assignments}
    assert not used & {"slow-link", "far-away", "no-memory"}
    assert plan.makespan_s == pytest.approx(plan_gemm(good, 64, 96, 512, 2).makespan_s, rel=1e-3)
    assert plan.devices_used < len(both)


def test_clear_errors_for_empty_fleets_and_gemms_no_device_can_hold():
    with pytest.raises(PlanError, match="empty"):
        plan_gemm([], 8, 8, 8, 2)
    tiny = Fleet(("a",), np.array([1e9]), np.array([1000]), np.array([1e6]), np.array([1e6]), np.array([0.0]))
    with pytest.raises(PlanError, match=r"needs 4002 bytes .* largest device memory is 1000"):
        plan_gemm(tiny, 8, 8, 1000, 2, name="big-k")
    with pytest.raises(PlanError, match="dtype_bytes"):
        plan_gemm(tiny, 8, 8, 8, 3)


def test_fleet_file_errors_name_the_bad_entry(tmp_path):
    good = synthetic_fleet(3, seed=0).to_json_list()
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(good))
    assert load_fleet(path).ids == tuple(d["id"] for d in good)
    bad = [good[0], {**good[1], "downlink_bytes_per_s": -5}]
    path.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"entry 1 \(id 'dev-00001'\): downlink_bytes_per_s"):
        load_fleet(path)
    path.write_text(json.dumps([good[0], {"id": "x", "flops": 1.0}]))
    with pytest.raises(ConfigError, match=r"entry 1 \(id 'x'\): missing memory_bytes"):
        load_fleet(path)
    path.write_text(json.dumps([good[0], good[0]]))
    with pytest.raises(ConfigError, match="repeats id 'dev-00000'"):
        load_fleet(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        load_fleet(path)


def test_even_split_uses_every_device_and_the_planner_beats_it():
    fleet = synthetic_fleet(300, seed=2)
    even = even_split(fleet, 8192, 2048, 2048, 2)
    assert_valid(even, fleet)
    assert even.devices_used == len(fleet)
    plan = plan_gemm(fleet, 8192, 2048, 2048, 2)
    assert even.makespan_s > 2 * plan.makespan_s


def test_ps_egress_counts_each_input_once():
    fleet = synthetic_fleet(1000, seed=0)
    free = plan_gemm(fleet, 8192, 2048, 2048, 2)
    assert free.egress_s == 0 and free.makespan_s == free.device_time_s
    capped = plan_gemm(fleet, 8192, 2048, 2048, 2, ps_bandwidth=1e9)
    egress = (8192 + 2048) * 2048 * 2 / 1e9  # every row of A and column of B published once
    assert capped.egress_s == pytest.approx(egress)
    assert capped.makespan_s == pytest.approx(max(egress, capped.device_time_s))
    assert capped.lower_bound_s >= egress


def test_replans_when_devices_leave_and_join():
    fleet = synthetic_fleet(200, seed=4)
    before = plan_gemm(fleet, 4096, 1024, 1024, 2)
    busiest = {fleet.ids[d] for d in np.unique(before.dev)[:20]}
    after = plan_gemm(fleet.without(busiest), 4096, 1024, 1024, 2)
    assert_valid(after, fleet.without(busiest))
    assert not {a.device for a in after.assignments} & busiest
    assert after.makespan_s >= before.makespan_s * (1 - 1e-3)
    strong = Fleet(
        ("new-fast",),
        np.array([1e13]),
        np.array([2**30]),
        np.array([1e9]),
        np.array([1e9]),
        np.array([0.001]),
    )
    joined = Fleet.of([*fleet.devices(), *strong.devices()])
    grown = plan_gemm(joined, 4096, 1024, 1024, 2)
    assert_valid(grown, joined)
    assert "new-fast" in {a.device for a in grown.assignments}
    assert grown.makespan_s < before.makespan_s


def test_plan_command_json_and_table():
    out = io.StringIO()
    assert plan_command("tiny", "synthetic:50", batch=4, seq=64, dtype="fp32", as_json=True, out=out) == 0
    doc = json.loads(out.getvalue())
    for key in (
        "plan_time_s",
        "predicted_step_s",
        "lower_bound_s",
        "devices_used",
        "gemms",
        "even_split_ratio",
    ):
        assert key in doc
    assert doc["predicted_step_s"] >= doc["lower_bound_s"] > 0
    for g in doc["gemms"]:
        assert {"name", "m", "n", "k", "count_per_step", "makespan_s", "assignments"} <= g.keys()
        area = sum((a["row1"] - a["row0"]) * (a["col1"] - a["col0"]) for a in g["assignments"])
        assert area == g["m"] * g["n"]
    table = io.StringIO()
    plan_command("tiny", "synthetic:50", batch=4, seq=64, out=table)
    assert "predicted step" in table.getvalue()
    with pytest.raises(ConfigError, match="--seq"):
        plan_command("tiny", "synthetic:50", batch=4, seq=10_000)
    with pytest.raises(ConfigError, match="synthetic:N"):
        plan_command("tiny", "synthetic:zero", batch=4, seq=64)


def test_register_adds_the_plan_subcommand(capsys):
    parser = argparse.ArgumentParser(prog="cleave")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        [
            "plan",
            "--model",
            "tiny",
            "--fleet",
            "synthetic:20",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--precision",
            "bf16",
            "--ps-bandwidth",
            "1e9",
            "--json",
            "--no-assignments",
        ]
    )
    assert args.func(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dtype"] == "bf16" and doc["ps_bandwidth"] == 1e9
    assert all("assignments" not in g and g["ps_egress_s"] > 0 for g in doc["gemms"])
    old = parser.parse_args(["plan", "--model", "tiny", "--fleet", "synthetic:20", "--batch", "2", "--seq", "32",
                             "--dtype", "bf16"])  # the earlier spellings still work
    assert (old.batch, old.seq, old.dtype) == (args.batch, args.seq, args.dtype)
    default = parser.parse_args(["plan", "--model", "tiny", "--fleet", "synthetic:20", "--batch-size", "2",
                                 "--seq-len", "32"])
    assert default.dtype == "fp32"  # as a job's default precision: a plan matches the job it plans
