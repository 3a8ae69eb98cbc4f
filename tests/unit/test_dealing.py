"""The scheduler's prediction of a plan's GEMMs (`cleave.gemm.predict.dealt_makespan`) against figures worked out
by hand, and against the simulator for the same fleet: one implementation (the PS's dealer) for both."""

import pytest

from cleave.gemm import predict
from cleave.models import gemm_shapes, get_preset
from cleave.plan import planner
from cleave.schemas import DeviceProfile, Plan, PlanWorker
from cleave.sim import simulate_step
from cleave.train.job import JobConfig
from cleave_scheduler.planning import with_layouts
from cleave_scheduler.synthetic import job_shapes

GFLOPS = 1e9
K = 50_000  # a 100 x 100 block: 2 * 100 * 100 * K = 1e9 FLOPs, one second at 1 GFLOP/s
FAST_LINK = 1e15  # bytes/s: links that cost nothing


def device(flops: float, down: float = FAST_LINK, up: float = FAST_LINK, latency_s: float = 0.0) -> DeviceProfile:
    return DeviceProfile(flops=flops, memory_bytes=1 << 30, downlink_bytes_per_s=down, uplink_bytes_per_s=up,
                         latency_s=latency_s)


def predicted(fleet: dict[str, DeviceProfile], m: int, n: int) -> tuple[float, float]:
    """(the dealer's prediction, each device alone) for the even split of C[m, n], one tile a block; the
    prediction alone and within a step (of that one GEMM) agree."""
    g = planner.even_split(fleet, m, n, K, 4)
    boxes = [(a.row0, a.row1, a.col0, a.col1) for a in g.assignments]
    owners = [a.device for a in g.assignments]
    args = (boxes, owners, fleet, K, 4, m, n, 1, 1)
    dealt = predict.dealt_makespan(*args)
    assert predict.step_makespans([(boxes, owners, K)], [0], fleet, 4, m, n, 1, 1) == [pytest.approx(dealt)]
    return dealt, predict.streamed_makespan(*args)


def test_a_lone_tile_costs_the_sum_of_its_stages():
    # two equal devices, a 100 x 100 block each: latency 0.01 s, down (100 + 100) rows x K x 4 B = 4e7 B at
    # 1e8 B/s = 0.4 s, compute 1 s, up 100 x 100 x 4 B = 4e4 B at 1e6 B/s = 0.04 s: 1.45 s in all
    fleet = {w: device(GFLOPS, down=1e8, up=1e6, latency_s=0.01) for w in ("a", "b")}
    dealt, alone = predicted(fleet, 200, 100)
    assert dealt == pytest.approx(1.45, rel=1e-9)
    assert alone == pytest.approx(1.45, rel=1e-9)


def test_a_straggler_in_the_even_split_is_copied_by_an_idle_device():
    """The case that was predicted 3.6x too slow: the even split's straggler. Each device alone, the
    straggler's block takes 10 s. The PS's dealer copies a tile that has run alone for over
    speculate_factor (3) x the usual round trip (1 s, the fast devices'), checking every tick_s (0.05 s):
    the copy leaves at 3.05 s and is done at 4.05 s."""
    fleet = {"a": device(GFLOPS), "b": device(GFLOPS), "slow": device(GFLOPS / 10)}
    dealt, alone = predicted(fleet, 300, 100)
    assert alone == pytest.approx(10.0, rel=1e-6)
    assert dealt == pytest.approx(4.05, rel=1e-6)


def test_past_the_budget_each_device_alone_is_the_prediction():
    fleet = {"a": device(GFLOPS), "b": device(GFLOPS), "slow": device(GFLOPS / 10)}
    g = planner.even_split(fleet, 300, 100, K, 4)
    boxes = [(a.row0, a.row1, a.col0, a.col1) for a in g.assignments]
    owners = [a.device for a in g.assignments]
    assert predict.dealt_makespan(boxes, owners, fleet, K, 4, 300, 100, 1, 1, budget=8) == pytest.approx(10.0)
    assert predict.step_makespans([(boxes, owners, K)], [0], fleet, 4, 300, 100, 1, 1, budget=8) == \
        [pytest.approx(10.0)]


# the six links of benchmarks/real_links.py as its workers measured them (benchmarks/results/real_links.json)
MEASURED = {  # down, up (bytes/s), latency (s), FLOPS
    "phone-a": (3.88e6, 1.30e6, 0.0023, 1.41e10), "phone-b": (5.40e6, 1.89e6, 0.0007, 9.90e10),
    "laptop-a": (1.04e7, 3.80e6, 0.0006, 3.30e10), "laptop-b": (8.05e6, 4.65e6, 0.0004, 9.06e10),
    "desktop": (1.51e7, 6.52e6, 0.0002, 2.21e10), "straggler": (9.5e5, 5.07e5, 0.0007, 4.19e10),
}


@pytest.mark.parametrize(("kind", "rel"), [("cost", 1e-9), ("even", 0.08)])
def test_the_scheduler_predicts_what_the_simulator_simulates(kind, rel):
    """For the shaped fleet of benchmarks/real_links.py: the scheduler's plan (`with_layouts`) predicts the
    simulated step: the cost plan exactly (5.24 s), the even split within 8% (9.36 s predicted, 9.92 s
    simulated: the prediction deals one layer of each kind, the simulator every layer, and the straggler's
    copies and suspicions fall differently), where each device alone took 35.9 s, 3.6x too long."""
    fleet = {w: DeviceProfile(flops=f, memory_bytes=512 * 1024**2, downlink_bytes_per_s=d, uplink_bytes_per_s=u,
                              latency_s=lat) for w, (d, u, lat, f) in MEASURED.items()}
    job = JobConfig(job_id="v", preset="small")  # as the benchmark trains it
    shapes = gemm_shapes(get_preset(job.preset), job.batch_size, job.seq)
    plan = Plan(version=1, created_at=0.0, tile_rows=1024, tile_cols=1024, chunks=4,
                workers=[PlanWorker(worker_id=w, profile=p, cache_bytes=128 * 1024**2) for w, p in fleet.items()])
    predicted = with_layouts(plan, job_shapes(job.preset, job.batch_size, job.seq, 4), kind, None).predicted_step_s
    simulated = simulate_step(fleet, shapes, 4, planner=kind, steps=2)
    assert predicted == pytest.approx(simulated, rel=rel)


def test_a_half_precision_job_is_planned_with_two_bytes_on_the_links_and_four_in_memory():
    """A bf16 job's inputs and results travel in 2 bytes, but its workers compute in float32: the plan's
    link costs use 2 bytes an element (a link-bound step predicted much faster than fp32's) while
    every planned block still fits its device's memory at 4 bytes an element."""
    from cleave.plan.costmodel import tile_memory_bytes
    from cleave.schemas import COMPUTE_DTYPE_BYTES

    fleet = {f"d{i}": DeviceProfile(flops=1e12, memory_bytes=512 * 1024, downlink_bytes_per_s=1e7 * (1 + i % 3),
                                    uplink_bytes_per_s=5e6, latency_s=0.01) for i in range(6)}
    plan = Plan(version=1, created_at=0.0, tile_rows=1024, tile_cols=1024, chunks=4,
                workers=[PlanWorker(worker_id=w, profile=p, cache_bytes=8 * 1024**2) for w, p in fleet.items()])
    fp32 = job_shapes("small", 4, 128, 4)
    bf16 = fp32.model_copy(update={"dtype_bytes": 2, "memory_dtype_bytes": COMPUTE_DTYPE_BYTES})
    one, half = (with_layouts(plan, s, "cost", None) for s in (fp32, bf16))
    assert 0.45 < half.predicted_step_s / one.predicted_step_s < 0.75  # (latency and the tiling keep it above 0.5)
    def overflows(plan):  # planned blocks that a float32 worker could not hold
        return sum(int(need) > fleet[o].memory_bytes for g in plan.gemms
                   for need, o in zip(tile_memory_bytes(g.boxes.array[:, 1] - g.boxes.array[:, 0],
                                                        g.boxes.array[:, 3] - g.boxes.array[:, 2], g.k,
                                                        COMPUTE_DTYPE_BYTES), g.owners, strict=True))

    assert overflows(half) == 0
    assert overflows(with_layouts(plan, bf16.model_copy(update={"memory_dtype_bytes": None}), "cost", None)) > 0
