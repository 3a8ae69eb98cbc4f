"""`cleave plan` and `cleave sim` as a user meets them: the plan is the one the runtime makes for the same job,
and a bad value is refused in one line that names its flag (no traceback, no hang)."""

import argparse
import io
import json

import numpy as np
import pytest

from cleave.errors import ConfigError
from cleave.models import gemm_shapes, get_preset
from cleave.plan.fleet import Fleet, load_fleet, synthetic_fleet
from cleave.plan.planner import plan_model
from cleave.train.job import JobConfig
from cleave_cli import sim_cmd
from cleave_cli.plan_cmd import plan_command


def sim_config(*argv):
    parser = argparse.ArgumentParser()
    sim_cmd.register(parser.add_subparsers(dest="command"))
    return sim_cmd.config(parser.parse_args(["sim", *argv]))


def plan_json(*args, **kwargs):
    out = io.StringIO()
    assert plan_command(*args, as_json=True, assignments=False, out=out, **kwargs) == 0
    return json.loads(out.getvalue())


def test_cleave_plan_plans_the_gemms_the_jobs_ps_describes():
    # GPT-2 Medium at 2 x 1024: the PS runs the head in 2 chunks of tokens and its input gradient over 13
    # slices of the vocabulary (JobConfig.layout); `cleave plan` planned one whole 2048 x 50257 head
    doc = plan_json("gpt2-medium", "synthetic:20", 2, 1024)
    layout = JobConfig(preset="gpt2-medium", batch_size=2, seq_len=1024, recompute=False).layout()
    assert (layout.head_chunks, layout.head_slices) == (2, 13)
    job = gemm_shapes(get_preset("gpt2-medium"), 2, 1024, layout)
    assert [(g["name"], g["m"], g["n"], g["k"], g["count_per_step"]) for g in doc["gemms"]] == [
        (g.name, g.m, g.n, g.k, g.count_per_step) for g in job
    ]
    assert doc["head_chunks"] == 2
    assert plan_json("gpt2-medium", "synthetic:20", 2, 1024, head_chunks=4)["head_chunks"] == 4


def test_a_half_precision_job_is_planned_with_float32_in_device_memory(tmp_path):
    # the PS tells the scheduler memory_dtype_bytes 4 for a bf16/fp16 job (its workers compute in float32);
    # `cleave plan --precision fp16` planned 2 bytes: blocks twice as large as a device can hold
    base = synthetic_fleet(8, seed=1)
    fleet = Fleet(base.ids, base.flops, np.full(8, 2**16, dtype=np.int64), base.downlink, base.uplink, base.latency)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet.to_json_list()))
    shapes = gemm_shapes(get_preset("tiny"), 4, 64)
    runtime = plan_model(fleet, shapes, 2, None, memory_dtype_bytes=4).predicted_step_s
    assert runtime != plan_model(fleet, shapes, 2, None).predicted_step_s
    assert plan_json("tiny", str(path), 4, 64, dtype="fp16")["predicted_step_s"] == pytest.approx(runtime)


def test_a_fleet_file_that_is_not_text_is_refused_in_one_line(tmp_path):
    path = tmp_path / "fleet.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="fleet.json: not JSON"):
        load_fleet(path)


def test_a_negative_seed_is_refused_by_name():
    with pytest.raises(ConfigError, match="--seed must be at least 0, got -1"):
        plan_command("tiny", "synthetic:4", 2, 64, seed=-1)
    with pytest.raises(ConfigError, match="--seed must be at least 0, got -1"):
        sim_config("--model", "tiny", "--seq-len", "64", "--seed", "-1")


@pytest.mark.parametrize("churn", ["nan", "inf"])
def test_a_churn_that_is_no_rate_is_refused_not_simulated_forever(churn):
    with pytest.raises(ConfigError, match="--churn non-negative"):
        sim_config("--model", "tiny", "--seq-len", "64", "--churn", churn)


@pytest.mark.parametrize("value", ["1e-300", "inf", "nan", "-1"])
def test_a_ps_bandwidth_beyond_a_links_range_is_refused_by_name(value):
    # 1e-300 bytes/s overflowed every time to inf: `cleave plan` printed a gap of nan%, `cleave sim` a traceback
    with pytest.raises(ConfigError, match="--ps-bandwidth must be 1000 to 1e\\+15 bytes/s, or 0 for unlimited"):
        sim_config("--model", "tiny", "--seq-len", "64", "--ps-bandwidth", value)
    with pytest.raises(ConfigError, match="--ps-bandwidth must be 1000 to 1e\\+15 bytes/s; got"):
        plan_command("tiny", "synthetic:4", 2, 64, ps_bandwidth=float(value))
    assert sim_config("--model", "tiny", "--seq-len", "64", "--ps-bandwidth", "0").ps_bandwidth is None


def test_a_fleet_that_churns_away_is_infeasible_not_a_traceback():
    from cleave.sim.systems import SimConfig, compare

    doc = compare(SimConfig(model="tiny", devices=4, batch=2, seq=64, churn=100_000.0, systems=("cleave",)))
    me = doc["systems"]["cleave"]
    assert not me["feasible"] and "no worker left" in me["note"]


def test_sim_memory_help_names_the_default_a_fleet_file_gets(tmp_path):
    from cleave.sim.systems import build_fleet

    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(synthetic_fleet(2, seed=3).to_json_list()).replace("536870912", "1073741824"))
    assert set(build_fleet(sim_config("--model", "tiny", "--seq-len", "64", "--fleet", str(path))).memory_bytes) == {
        2**30
    }
    parser = argparse.ArgumentParser()
    sim_cmd.register(parser.add_subparsers(dest="command"))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["sim"]
    memory = next(a for a in sub._actions if a.dest == "memory")
    assert "the fleet's own" in memory.help and "512 MiB in a synthetic fleet" in memory.help


def test_a_fleet_of_more_than_200000_devices_is_planned_not_called_short_of_memory():
    # `cleave plan --fleet synthetic:1000000` (the largest synthetic fleet) was refused: "device memory is
    # too small ... the plan would need more than 200000 tiles", counting each device's one tile
    from cleave.plan.planner import plan_gemm

    fleet = synthetic_fleet(250_000)
    gp = plan_gemm(fleet, 8192, 4096, 1024, 2)
    assert 0 < gp.devices_used < len(fleet) and gp.gap < 0.01


@pytest.mark.parametrize(("argv", "message"), [
    (["--chunks", "65"], "--chunks must be 1 to 64, as the scheduler's plan carries it; got 65"),
    (["--memory", str(2**50 + 1)], "--memory must be 1 to 1125899906842624 bytes"),
    (["--window", "1000000"], "--window must be 1 to 64, as the PS's window setting"),  # (minutes, 1.6 GB)
    # (the simulator dealt them for hours: ~40,000 tiles a second)
    (["--tile", "1x1", "--batch", "64", "--steps", "2"], r"--tile 1x1 cuts 2 step\(s\) of tiny at 64 x 64 tokens "
                                                         "into at least 19,628,032 tiles; a run simulates at most"),
])
def test_sim_refuses_what_the_runtime_cannot_run_by_flag(argv, message):
    # --chunks 100000 simulated for ever (a plan carries at most 64); --memory past a profile's range was
    # refused as "DeviceProfile: invalid setting memory_bytes", naming no flag
    with pytest.raises(ConfigError, match=message):
        sim_config("--model", "tiny", "--seq-len", "64", *argv)
    assert sim_config("--model", "tiny", "--seq-len", "64", "--chunks", "64").chunks == 64


def test_the_table_shows_a_fast_fleets_times_not_zeros(tmp_path):
    # three data-centre-class devices plan tiny's step in microseconds: the table printed 0.0000 and 0.000 s
    fast = {"flops": 1e15, "memory_bytes": 2**34, "downlink_bytes_per_s": 1e12, "uplink_bytes_per_s": 1e12,
            "latency_s": 0.0}
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps([{"id": f"gpu-{i}", **fast} for i in range(3)]))
    out = io.StringIO()
    plan_command("tiny", str(path), 4, 64, out=out)
    rows, totals = out.getvalue().splitlines()[2:-1], out.getvalue().splitlines()[-1]
    assert all(float(row.split()[6]) > 0 for row in rows)
    assert float(totals.split("predicted step ")[1].split()[0]) > 0


@pytest.mark.parametrize("flag", ["--report-models", "--report-devices"])
def test_a_sweep_flag_without_report_is_refused_not_ignored(flag):
    with pytest.raises(ConfigError, match=f"{flag} sets the sweep of --report DIR; give --report too"):
        sim_config("--model", "tiny", "--seq-len", "64", flag, "16" if flag == "--report-devices" else "tiny")


@pytest.mark.parametrize(("argv", "message"), [
    (["--ps-flops", "1e-300"], "--ps-flops must be 1e\\+06 to 1e\\+18; got 1e-300"),
    (["--ps-flops", "inf"], "--ps-flops must be"),
    (["--ps-link", "inf"], "--ps-link must be 1000 to 1e\\+15; got inf"),
    (["--ps-memory", "inf"], "--ps-memory must be 1 to"),
    (["--replan-every", "inf"], "--replan-every must be seconds"),
])
def test_sim_refuses_a_ps_or_replan_value_that_makes_its_json_infinite(argv, message):
    # each was simulated, and `--json` printed Infinity (no JSON parser but Python's reads it)
    with pytest.raises(ConfigError, match=message):
        sim_config("--model", "tiny", "--seq-len", "64", *argv)


def test_plan_fleet_synthetic_without_a_size_asks_for_one():
    # `cleave sim --fleet synthetic` is a fleet; `cleave plan --fleet synthetic` said "cannot read fleet file"
    with pytest.raises(ConfigError, match="--fleet 'synthetic': expected synthetic:N"):
        plan_command("tiny", "synthetic", 2, 64)


def test_a_fleet_of_stragglers_only_is_simulated():
    # `cleave sim --stragglers 1` (or 0.99 on 8 devices) ended in "max() arg is an empty sequence": the
    # recovery drill looked for a victim among the devices that are not stragglers
    from cleave.sim.systems import SimConfig, compare

    me = compare(SimConfig(model="tiny", devices=4, batch=2, seq=64, stragglers=1.0, systems=("cleave",)))
    me = me["systems"]["cleave"]
    assert me["feasible"] and me["step_s"] > 0 and me["recovery_s"] > 0


def test_a_batch_no_device_can_hold_names_the_flags_that_fix_it():
    from cleave.errors import PlanError

    # tiny's weight gradients have k = the batch's tokens: 2,000,000 x 64 of them need 1 GB for one element
    with pytest.raises(PlanError, match="smallest tile .*; for this job: a smaller --batch-size or --seq-len, "
                                        "more --micro-batches, or devices with more memory"):
        plan_command("tiny", "synthetic:4", 2_000_000, 64)


def test_a_fleet_file_number_written_as_true_is_refused(tmp_path):
    # "memory_bytes": true was read as 1 byte (and "latency_s": false as 0 s)
    entry = synthetic_fleet(1).to_json_list()[0] | {"memory_bytes": True}
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps([entry]))
    with pytest.raises(ConfigError, match="entry 0 .*: memory_bytes: expected a number \\(got True\\)"):
        load_fleet(path)


def test_the_ps_window_is_bounded() -> None:
    """A PS's dealing steps through every depth of its window for each GEMM: a window of a million stalled it."""
    from cleave_ps.settings import PsSettings  # noqa: PLC0415

    assert PsSettings(window=64).window == 64
    with pytest.raises(ConfigError, match="invalid setting window: Input should be less than or equal to 64"):
        PsSettings(window=65)
