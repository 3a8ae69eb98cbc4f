"""The simulator's bill for the PS (`cleave.sim.ps`), against figures worked out by hand for the `tiny` preset
(GPT-2: 2 layers, 2 heads, n_embd 64, MLP 256, vocab 256, block 64, tied head) at batch 2 x 8 tokens, fp16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cleave.models.gemms import DEFAULT_LOGITS_BYTES
from cleave.sim.ps import (
    PsSpec,
    allreduce_s,
    charge,
    egress_share,
    ps_flops,
    ps_memory,
    replicas_by_memory,
    step_with_replicas,
)
from cleave.sim.systems import DEFAULT_PS_BANDWIDTH, SimConfig
from cleave.sim.workload import Workload

# weights of the linear layers (2 x (64x192 + 64x64 + 64x256 + 256x64)) and the embeddings (256x64 + 64x64)
PARAMS = 2 * (12288 + 4096 + 16384 + 16384) + 16384 + 4096  # 118,784


@pytest.fixture(scope="module")
def work() -> Workload:
    return Workload.of("tiny", batch=2, seq=8, dtype="fp16")


def test_the_workload_counts_the_parameters_by_hand(work):
    assert work.params == PARAMS


def test_the_ps_flops_by_hand(work):
    f = ps_flops(work)
    # Q·Kᵀ and P·V: 2·T·T·C each per sample and layer = 2·8·8·64 = 8,192; x2 products x2 samples x2 layers
    # forward = 65,536, and the backward twice that
    assert f["attention"] == 65_536 * 3
    # 5 a score: 16 tokens x 2 heads x 8 keys x 2 layers = 512 scores, forward and backward (x3)
    assert f["softmax"] == 5 * 512 * 3
    # a token and layer: 2 norms x 8 x 64 + GELU 10 x 256 + 2 residual adds x 64 = 3,712; x16 tokens x2
    # layers, plus the final norm 16 x 8 x 64, forward and backward
    assert f["elementwise"] == (3712 * 16 * 2 + 16 * 8 * 64) * 3
    assert f["loss"] == 5 * 16 * 256 * 3
    assert f["optimizer"] == 14 * PARAMS
    assert f["total"] == 196_608 + 7_680 + 380_928 + 61_440 + 14 * PARAMS


def test_the_ps_memory_by_hand(work):
    m = ps_memory(work)
    assert m["state"] == 16 * PARAMS
    # 17 elements of 2 bytes per token, hidden unit and layer, and the float32 logits of the head's one chunk
    assert m["logits"] == 16 * 256 * 4
    assert m["activations"] == 16 * 64 * 2 * 17 * 2 + 16 * 256 * 4  # 86,016
    half = ps_memory(work, replicas=2)
    assert half["state"] == m["state"] and half["activations"] == m["activations"] / 2


def test_the_ps_holds_the_logits_of_one_chunk_of_the_head():
    """The PS runs the head and the loss in chunks of tokens (`JobConfig.layout`): GPT-2 Medium at 8 x 1,024
    holds 1,024 tokens' logits at once, not 8,192 tokens' (1.6 GB)."""
    work = Workload.of("gpt2-medium", 8, 1024)
    assert ps_memory(work)["logits"] == 4 * 50257 * 1024 <= DEFAULT_LOGITS_BYTES
    assert ps_memory(work, replicas=8)["logits"] == 4 * 50257 * 1024  # (one chunk of its 1,024 tokens)


def test_replicas_by_memory_split_the_activations_not_the_state(work):
    state = 16 * PARAMS
    assert replicas_by_memory(work, state + 86_016) == 1
    assert replicas_by_memory(work, state + 43_008) == 2
    assert replicas_by_memory(work, state + 10_000) == 9  # ceil(86,016 / 10,000)
    assert replicas_by_memory(work, state) is None  # nothing is left for activations on any replica


def test_a_replicas_egress_splits_what_carries_tokens(work):
    # per kind (K, N, count): forward and dX send 16·K and 16·N token rows and the K·N weight twice; dW
    # sends (N + K)·16: split 64·count·(K + N) bytes, whole 4·count·K·N
    split = 64 * (2 * 256 + 2 * 128 + 2 * 320 + 2 * 320 + 320)
    whole = 4 * (2 * 12288 + 2 * 4096 + 2 * 16384 + 2 * 16384 + 16384)
    assert egress_share(work, 1) == 1.0
    assert egress_share(work, 2) == pytest.approx((split / 2 + whole) / (split + whole), rel=1e-12)


def test_the_gradient_all_reduce_on_the_ps_link(work):
    spec = PsSpec(link=1e6, link_latency_s=0.01)
    # ring: 2 x ((R - 1) / R x bytes / bandwidth + (R - 1) x hop), a hop being both ends' latency
    assert allreduce_s(work, spec, 4) == pytest.approx(2 * (0.75 * PARAMS * 4 / 1e6 + 3 * 0.02), rel=1e-12)
    assert allreduce_s(work, spec, 1) == 0.0


def test_a_step_with_replicas_scales_the_bound_that_binds(work):
    spec = PsSpec(flops=1e6, link=1e9, link_latency_s=0.0)
    fleet = {"gemm_step_s": 100.0, "ps_bytes": 1e9, "ps_bandwidth": 1e8, "fleet_s": 5.0}  # egress 10 s binds
    row = step_with_replicas(work, spec, fleet, 2)
    assert row["egress_s"] == pytest.approx(10 * egress_share(work, 2))
    assert row["gemm_s"] == pytest.approx(100 * egress_share(work, 2))
    assert row["compute_s"] == pytest.approx(ps_flops(work)["total"] / 1e6 / 2)
    assert row["step_s"] == pytest.approx(row["gemm_s"] + row["compute_s"] + allreduce_s(work, spec, 2))
    one = step_with_replicas(work, spec, fleet, 1)
    assert one["gemm_s"] == 100.0 and one["allreduce_s"] == 0.0


def test_charge_names_what_bounds_one_ps(work):
    fleet = {"gemm_step_s": 100.0, "ps_bytes": 1e9, "ps_bandwidth": 1e8, "fleet_s": 50.0}
    slow = charge(work, PsSpec(flops=1e3), fleet)  # ~2,310 s of its own work
    assert slow["bound"] == "ps_compute"
    assert slow["step_s"] == pytest.approx(100.0 + ps_flops(work)["total"] / 1e3)
    assert slow["replicas"] > 1 and slow["with_replicas"]["step_s"] < slow["step_s"]
    fast = charge(work, PsSpec(flops=1e15), fleet)
    assert fast["bound"] == "fleet" and fast["replicas"] == 1
    thin = charge(work, PsSpec(flops=1e15), {**fleet, "ps_bandwidth": 1e7})  # egress 100 s > fleet 50 s
    assert thin["bound"] == "ps_egress"
    small = charge(work, PsSpec(memory_bytes=16 * PARAMS + 43_008), fleet)
    assert small["bound"] == "ps_memory" and small["replicas_by_memory"] == 2 and small["replicas"] >= 2
    assert charge(work, PsSpec(memory_bytes=16 * PARAMS), fleet)["replicas"] is None


def sim_json(argv: list[str], capsys) -> dict:
    import argparse
    import json

    from cleave_cli import sim_cmd

    parser = argparse.ArgumentParser()
    sim_cmd.register(parser.add_subparsers(dest="command"))
    assert sim_cmd.run(parser.parse_args(["sim", *argv, "--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_cleave_sim_charges_the_ps_its_own_work(capsys):
    job = ["--model", "opt-125m", "--devices", "16", "--batch", "8", "--seq", "128", "--systems", "cleave"]
    slow = sim_json([*job, "--ps-flops", "1e9", "--ps-memory", "1e12", "--ps-link", "1e8"], capsys)
    me, work = slow["systems"]["cleave"], Workload.of("opt-125m", 8, 128)
    assert me["ps"]["compute_s"] == pytest.approx(ps_flops(work)["total"] / 1e9)
    assert me["step_s"] == pytest.approx(me["gemm_step_s"] + me["ps"]["compute_s"])
    assert me["ps"]["bound"] == "ps_compute" and me["ps"]["fits_one_ps"]
    assert me["ps"]["spec"] == {"flops": 1e9, "memory_bytes": 1e12, "link": 1e8}
    tight = sim_json([*job, "--ps-memory", str(ps_memory(work)["state"] + 1e6)], capsys)["systems"]["cleave"]
    assert tight["ps"]["bound"] == "ps_memory" and tight["ps"]["replicas_by_memory"] > 1


def test_cleave_sim_refuses_a_ps_without_memory():
    import argparse

    from cleave.errors import ConfigError
    from cleave_cli import sim_cmd

    parser = argparse.ArgumentParser()
    sim_cmd.register(parser.add_subparsers(dest="command"))
    with pytest.raises(ConfigError, match="--ps-memory"):
        sim_cmd.config(parser.parse_args(["sim", "--ps-memory", "0"]))
    with pytest.raises(ConfigError, match="--ps-bandwidth must be 1000 to 1e\\+15 bytes/s, or 0 for unlimited"):  # (was taken)
        sim_cmd.config(parser.parse_args(["sim", "--ps-bandwidth", "-5"]))


def test_the_default_ps_link_is_what_one_ps_process_was_measured_to_send():
    """`DEFAULT_PS_BANDWIDTH` follows the committed measurements: the PS's CPU a byte moved (in + out) in
    benchmarks/results/ps_rate.json, and the share of results coming back at the default point in the committed
    report (docs/img/sim/report.json). Rerunning ps_rate.py to a different rate fails this test until the
    constant, and the simulations that use it, are updated."""
    root = Path(__file__).resolve().parents[2]
    rate = json.loads((root / "benchmarks/results/ps_rate.json").read_text())
    report = json.loads((root / "docs/img/sim/report.json").read_text())
    base = SimConfig()
    point = next(p for p in report["points"] if p["model"] == base.model and p["devices"] == base.devices)
    me = point["systems"]["cleave"]
    ingress_share = me["per_device_up_bytes"] * base.devices / me["ps_bytes_per_step"]
    sent_per_s = 1e9 / (rate["ps_cpu_per_byte_ns"] * (1 + ingress_share))
    assert report["spec"]["base"]["ps_bandwidth"] == DEFAULT_PS_BANDWIDTH  # the report was made with it
    assert sent_per_s == pytest.approx(DEFAULT_PS_BANDWIDTH, rel=0.15)
