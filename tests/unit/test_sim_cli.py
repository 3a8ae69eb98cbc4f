"""`cleave sim` takes its flags as `cleave plan` does: the same fleet specs, the same job checks, and every
bad flag refused up front by name."""

import argparse
import json

import pytest

from cleave.errors import ConfigError
from cleave.plan.fleet import synthetic_fleet
from cleave.sim.systems import build_fleet
from cleave_cli import sim_cmd


def parse(*argv):
    parser = argparse.ArgumentParser()
    sim_cmd.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["sim", *argv])


def config(*argv):
    return sim_cmd.config(parse(*argv))


@pytest.fixture
def two_devices(tmp_path):
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(synthetic_fleet(2, seed=3).to_json_list()))
    return str(path)


def test_a_synthetic_fleet_is_spelled_as_for_plan_or_as_before():
    new = config("--fleet", "synthetic:4")
    assert (new.fleet, new.devices) == ("synthetic", 4)
    old = config("--fleet", "synthetic", "--devices", "4")
    assert (old.fleet, old.devices) == ("synthetic", 4)
    assert config().devices == 256
    assert config("--fleet", "synthetic:4", "--devices", "4").devices == 4
    with pytest.raises(ConfigError, match="--devices 8 disagrees with --fleet synthetic:4"):
        config("--fleet", "synthetic:4", "--devices", "8")
    with pytest.raises(ConfigError, match="synthetic:N with N from 1"):  # cleave plan's own message
        config("--fleet", "synthetic:0")


def test_a_fleet_file_without_devices_is_taken_whole(two_devices):
    cfg = config("--fleet", two_devices)
    assert (cfg.fleet, cfg.devices) == (two_devices, 2)
    assert len(build_fleet(cfg)) == 2
    assert len(build_fleet(config("--fleet", two_devices, "--devices", "1"))) == 1
    with pytest.raises(ConfigError, match="has only 2 devices"):
        build_fleet(config("--fleet", two_devices, "--devices", "3"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--memory", "0"], "--memory must be 1 to"),
        (["--memory", "-1"], "--memory must be 1 to"),
        (["--systems", ""], "--systems names no system"),
        (["--systems", " , "], "--systems names no system"),
        (["--systems", "cleave,nope"], "unknown system nope"),
        (["--model", "tiny", "--seq-len", "1000"], "--seq-len must be between 1 and tiny's block_size 64"),
        (["--seq-len", "0"], "--seq-len must be between 1"),
        (["--batch-size", "0"], "--batch-size must be a positive integer"),
        (["--ps-bandwidth", "-1"], "--ps-bandwidth must be 1000 to 1e\\+15 bytes/s, or 0 for unlimited"),
        (["--replan-every", "-1"], "--replan-every must be seconds"),
        (["--devices", "0"], "--devices must be at least 1"),
    ],
)
def test_a_bad_flag_is_refused_up_front_by_name(argv, message):
    with pytest.raises(ConfigError, match=message):
        config(*argv)


def test_plan_and_sim_check_a_job_with_one_rule(capsys):
    from cleave_cli.plan_cmd import plan_command

    with pytest.raises(ConfigError, match="tiny's block_size 64, got 65") as plan:
        plan_command("tiny", "synthetic:4", 2, 65)
    with pytest.raises(ConfigError) as sim:
        config("--model", "tiny", "--batch-size", "2", "--seq-len", "65")
    assert str(sim.value) == str(plan.value)
    assert config("--model", "tiny", "--seq-len", "64").seq == 64
