"""The step breakdown (`cleave.sim.breakdown`) adds up to the simulated step, and the levers
(`cleave.sim.levers`) change what they say they change, on a small simulated fleet."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cleave.sim.breakdown import step_breakdown
from cleave.sim.levers import LEVERS, Lever, fused_shapes, lever_simulation, run_lever
from cleave.sim.step import Simulation
from cleave.sim.systems import SimConfig, build_world, simulation
from cleave.sim.workload import Workload

CFG = SimConfig(model="opt-125m", devices=16, batch=4, seq=256, systems=("cleave",))


def test_the_breakdown_adds_up_to_the_step():
    work = Workload.of(CFG.model, CFG.batch, CFG.seq, CFG.dtype)
    sim = simulation(CFG, work, build_world(CFG))
    b = step_breakdown(sim)
    plain = simulation(CFG, work, build_world(CFG)).step()
    assert b["step_s"] == pytest.approx(plain.step_s)  # the hook changes nothing
    kinds = b["kinds"].values()
    assert sum(k["seconds"] for k in kinds) == pytest.approx(b["step_s"])
    assert sum(k["count"] for k in kinds) == len(sim.order)
    assert sum(k["ps_bytes"] for k in kinds) == pytest.approx(b["ps_bytes"])
    assert b["ps_bytes"] >= 0.99 * b["distinct_input_bytes"]  # every input leaves the PS at least once
    assert sum(b["devices_bound_by"].values()) == b["devices_used"] == 16
    assert 0.0 <= b["device_idle_share"] < 1.0
    assert all(0.0 < s <= 1.0 for s in b["device_busy_share"].values())
    assert b["step_s"] >= b["compute_floor_s"] and b["step_s"] >= b["ps_egress_floor_s"]
    assert b["step_s"] >= b["lower_bound_s"] >= b["device_bound_s"] > 0
    assert b["planned_s"] >= b["lower_bound_s"]
    assert b["step_s"] >= b["busiest_device_s"] > 0


def test_a_cache_too_small_for_every_strip_counts_them_all():
    work = Workload.of(CFG.model, CFG.batch, CFG.seq, CFG.dtype)
    sim = lever_simulation(CFG, work, build_world(CFG), Lever("tiny cache", "", cache_bytes=1024))
    b = step_breakdown(sim)
    assert all(k["over_cache"] == k["strips"] and k["over_cache_bytes_share"] == 1.0 for k in b["kinds"].values())
    assert b["ps_bytes"] > 1.5 * b["distinct_input_bytes"]  # nothing fans out: strips go with every tile


def test_one_byte_strips_send_half_the_bytes_of_two():
    two, one = (run_lever(CFG, lv) for lv in (LEVERS[0], replace(LEVERS[0], name="1 B", dtype_bytes=1)))
    assert one["dtype_bytes"] == 1 and two["dtype_bytes"] == 2
    assert one["breakdown"]["distinct_input_bytes"] == pytest.approx(two["breakdown"]["distinct_input_bytes"] / 2)
    assert one["gemm_step_s"] < two["gemm_step_s"]  # the small fleet is bound by its links


def test_a_lever_can_bring_its_own_simulation():
    seen = []

    def build(cfg, work, world) -> Simulation:  # noqa: ANN001
        seen.append(cfg.model)
        return simulation(cfg, work, world)

    r = run_lever(CFG, Lever("own", "a simulation of its own", build=build))
    assert seen == [CFG.model] and r["step_s"] > r["gemm_step_s"] > 0


def test_without_fan_out_an_undisturbed_step_takes_the_dealt_prediction():
    """The breakdown's floors in order: lower bound <= planner's makespan <= dealt pieces = the step."""
    b = run_lever(replace(CFG, ps_bandwidth=None), Lever("no fan-out", "", fan_out=False))["breakdown"]
    assert b["step_s"] == pytest.approx(b["dealt_s"], rel=1e-6)
    assert b["lower_bound_s"] <= b["planned_s"] < b["dealt_s"]


def test_fusing_the_layers_that_read_one_input_keeps_every_flop():
    llama, opt = (Workload.of(m, 2, 64).shapes for m in ("llama2-7b", "opt-13b"))
    fused = fused_shapes(llama)
    assert len(fused) == len(llama) - 9  # q, k, v -> one and gate, up -> one, for fwd, dx and dw
    assert sum(s.flops * s.count_per_step for s in fused) == sum(s.flops * s.count_per_step for s in llama)
    qkv = {s.name.rsplit(".", 1)[1]: s for s in fused if "q_k_v" in s.name}
    assert (qkv["fwd"].n, qkv["dx"].k, qkv["dw"].m) == (3 * 4096,) * 3
    assert fused_shapes(opt) == list(opt)  # c_attn is fused already


def test_every_knob_of_a_lever_reaches_its_simulation():
    work = Workload.of(CFG.model, CFG.batch, CFG.seq, CFG.dtype)
    lever = Lever("all", "", cache_bytes=2**20, chunks=2, tile=(64, 64), dtype_bytes=1, fan_out=False, copies=False)
    sim = lever_simulation(CFG, work, build_world(CFG), lever)
    assert (sim.cache_bytes, sim.chunks, sim.tile, sim.dtype_bytes, sim.fan_out) == (2**20, 2, (64, 64), 1, False)
    assert sim.policy.speculate_factor == 0 and sim.cutter.cache_bytes == 2**20
    plain = lever_simulation(CFG, work, build_world(CFG), LEVERS[0])
    assert plain.policy.speculate_factor > 0 and plain.fan_out and plain.dtype_bytes == 2
