"""The simulator against a measured run: an emulated heterogeneous fleet (workers pacing themselves to
declared profiles) trains on loopback, and `cleave.sim.simulate_step` predicts its GEMMs' time per step.

The profiles are slow enough that the declared devices, not this machine, set the pace (about 0.15 s per
GEMM), so the comparison holds on a loaded CI machine; both figures are recorded with the test's report
(`record_property`) and printed.
"""

from __future__ import annotations

import statistics

import pytest

from cleave.job import JobConfig
from cleave.models import gemm_shapes, get_preset
from cleave.profile import parse_profile
from cleave.sim import simulate_step
from cleave_cli.jobrun import LocalFleet

PROFILES = {
    "fast": "flops=1G,down=4M,up=2M,latency=0.01,memory=512Mi",
    "mid": "flops=0.5G,down=2M,up=1M,latency=0.02,memory=512Mi",
    "slow": "flops=0.2G,down=1M,up=0.5M,latency=0.03,memory=512Mi",
}
WARMUP_STEPS = 2  # the first steps may run before the cost-aware plan for the job's shapes arrives
STEPS = 5
TOLERANCE = 0.2  # the aim: within 20%


@pytest.mark.timeout(240)
def test_the_simulator_predicts_a_measured_emulated_fleet_within_20_percent(tmp_path, nats_url, record_property):
    job = JobConfig(job_id="validate", preset="tiny", steps=STEPS)
    fleet = LocalFleet(tmp_path, 0, nats_url=nats_url)
    try:
        fleet.start()
        for name, spec in PROFILES.items():
            fleet.stack.service(name, "worker", ["--worker-id", name, "--profile", spec])
        fleet.start_ps(job, tmp_path / "m.jsonl")
        lines = fleet.wait_ps(tmp_path / "m.jsonl", timeout_s=200)
    finally:
        fleet.stop()
    body = [m for m in lines if m["step"] >= WARMUP_STEPS]
    assert body and all(m["predicted_gemm_s"] is not None for m in body), "steps ran without a cost-aware plan"
    measured = statistics.median(m["gemm_s"] for m in body)
    scheduler = statistics.median(m["predicted_gemm_s"] for m in body)

    profiles = {name: parse_profile(spec) for name, spec in PROFILES.items()}
    shapes = gemm_shapes(get_preset(job.preset), job.batch_size, job.seq)
    simulated = simulate_step(profiles, shapes, 4, steps=2)

    for key, value in (("measured_gemm_s", measured), ("simulated_gemm_s", simulated),
                       ("scheduler_predicted_gemm_s", scheduler)):
        record_property(key, round(value, 4))
    print(f"GEMMs per step: measured {measured:.3f} s, simulated {simulated:.3f} s "
          f"({measured / simulated:.2f}x), the scheduler's prediction {scheduler:.3f} s")
    assert abs(measured / simulated - 1) <= TOLERANCE
    assert scheduler == pytest.approx(simulated, rel=0.02)  # undisturbed, the two models agree
