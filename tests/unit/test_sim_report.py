"""What `cleave sim --report` runs: a chosen sweep runs only its own models and fleet sizes, churn curve
included, and says which point it is at (the simulations themselves faked: only the points are checked)."""

import argparse
import json

import pytest

from cleave.errors import ConfigError
from cleave.sim import plots, report
from cleave.sim.report import CHURN_RATES, ReportSpec
from cleave.sim.systems import SimConfig
from cleave_cli import sim_cmd

UNFIT = {"feasible": False, "step_s": None, "recovery_s": None, "devices_used": 0}


@pytest.fixture
def simulated(monkeypatch):
    """The configurations `compare` is asked for, in order (each answered with an infeasible Cleave)."""
    seen = []

    def compare(cfg):
        seen.append(cfg)
        return {"config": {"params": 1}, "systems": {"cleave": dict(UNFIT)}}

    monkeypatch.setattr(report, "compare", compare)
    monkeypatch.setattr(plots, "draw", lambda doc, out_dir: [])
    return seen


def run(*argv):
    parser = argparse.ArgumentParser()
    sim_cmd.register(parser.add_subparsers(dest="command"))
    return sim_cmd.run(parser.parse_args(["sim", *argv]))


def test_a_chosen_sweep_runs_its_churn_curve_on_its_own_points(simulated, tmp_path, capsys):
    assert run("--report", str(tmp_path), "--report-models", "opt-125m", "--report-devices", "32,16") == 0
    assert {(c.model, c.devices) for c in simulated} <= {("opt-125m", 16), ("opt-125m", 32)}
    doc = json.loads((tmp_path / "report.json").read_text())
    assert [(p["model"], p["devices"]) for p in doc["points"]] == [("opt-125m", 16), ("opt-125m", 32)]
    assert [(r["devices"], r["churn"]) for r in doc["churn"]] == [(32, rate) for rate in CHURN_RATES]
    assert (doc["spec"]["base"]["model"], doc["spec"]["base"]["devices"]) == ("opt-125m", 32)
    total = 2 + len(CHURN_RATES)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("]")[0] for line in lines] == [f"[{i}/{total}" for i in range(1, total + 1)]
    assert lines[-1].startswith(f"[{total}/{total}] sim opt-125m on 32 devices, churn {CHURN_RATES[-1]}")


def test_the_base_point_stays_where_the_sweep_has_it():
    full = ReportSpec.of(SimConfig())
    assert (full.base.model, full.base.devices) == ("opt-13b", 256)
    assert {c.devices for c in full.churn_configs()} == {256, 1024}
    assert {c.devices for c in full.sweep_configs() if c.model == "opt-13b"} >= {256, 10000}
    docs = ReportSpec.of(SimConfig(), None, "32,64,128,256,512,1024")  # docs/img/sim
    assert (docs.base.model, docs.base.devices) == ("opt-13b", 256)
    assert {(c.model, c.devices) for c in docs.churn_configs()} == {("opt-13b", 256)}
    some = ReportSpec.of(SimConfig(), "opt-1.3b,opt-350m", "64,64,16")
    assert (some.base.model, some.base.devices, some.devices) == ("opt-1.3b", 64, (16, 64))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--report-devices", "16,x"], "--report-devices '16,x': expected comma-separated fleet sizes"),
        (["--report-devices", "0,16"], "--report-devices '0,16': expected comma-separated fleet sizes"),
        (["--report-devices", ","], "--report-devices ',': expected"),
        (["--report-models", ","], "--report-models ',': expected"),
        (["--report-models", "opt-125m,nope"], "--report-models: unknown preset 'nope'"),
        (["--report-models", "tiny", "--seq-len", "128"], "--seq-len must be between 1 and tiny's block_size"),
    ],
)
def test_a_bad_sweep_is_refused_before_it_runs(simulated, tmp_path, argv, message):
    with pytest.raises(ConfigError, match=message):
        run("--report", str(tmp_path), "--model", "opt-125m", *argv)
    assert simulated == []
