"""The simulator's invariants: work is conserved and never lost under churn, clean runs match the planner,
the baselines refuse what memory forbids, traffic falls as devices join, and a seed fixes everything."""

import argparse
import json
import math

import numpy as np
import pytest

from cleave.gemm import predict, tiles
from cleave.gemm.dealer import DEFAULT_CACHE_BYTES, Dealer
from cleave.gemm.dealer import Policy as PsPolicy
from cleave.gemm.engine import OneGemm, fleet_of
from cleave.models import PRESETS, backward_pairs, build_model, gemm_shapes, step_order
from cleave.plan.fleet import synthetic_fleet
from cleave.schemas import DeviceProfile
from cleave.sim import plans as simplans
from cleave.sim.baselines import SystemResult
from cleave.sim.report import CHURN_RATES
from cleave.sim.step import Simulation, recovery_over_step, simulate_step
from cleave.sim.systems import SimConfig, compare, expected_step, with_churn
from cleave.sim.workload import Workload
from cleave.sim.world import World
from cleave.train.job import JobConfig
from cleave_cli import sim_cmd

SMALL = ("opt-125m", 8, 128)  # model, batch, seq: GEMMs of 1024 rows, simulated in milliseconds


def shapes(model=SMALL[0], batch=SMALL[1], seq=SMALL[2]):
    return gemm_shapes(PRESETS[model], batch, seq)


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("opt-125m", 0.125),
        ("opt-1.3b", 1.316),
        ("opt-13b", 12.85),
        ("opt-30b", 29.97),
        ("opt-66b", 65.7),
        ("llama2-7b", 6.738),
        ("llama2-13b", 13.016),
        ("llama2-70b", 68.98),
    ],
)
def test_presets_have_the_published_parameter_counts(name, billions):
    params = sum(p.numel() for p in build_model(PRESETS[name], device="meta").parameters())
    assert params / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize(("model", "batch", "seq"), [("opt-13b", 128, 1024), ("opt-125m", 16, 256), ("tiny", 4, 64)])
def test_the_simulator_deals_the_gemms_the_ps_deals(model, batch, seq):
    """The simulated step is the job's (`JobConfig.layout`: the head in chunks of tokens and slices of the
    vocabulary, as the PS runs it), while the baselines keep the one-pass model they were published with."""
    work = Workload.of(model, batch, seq)
    job = JobConfig(preset=model, batch_size=batch, seq_len=seq)
    assert list(work.shapes) == gemm_shapes(PRESETS[model], batch, seq, job.layout())
    assert work.step_flops == pytest.approx(sum(s.flops * s.count_per_step for s in work.one_pass))
    heads = {s.count_per_step for s in work.shapes if s.name == "lm_head.fwd"}
    assert heads == {job.layout().head_chunks} and (model == "tiny" or heads != {1})
    assert [s.count_per_step for s in work.one_pass if s.name.startswith("lm_head.")] == [1, 1, 1]


def gemm(world, shape, plan_kind="cost", tile=None, policy=None, leave_at=None, plans=(), chunks=4, fan_out=True):
    policy = policy or PsPolicy(window=1)
    cutter = simplans.Cutter(world, 2, plan_kind, tile, chunks, window=policy.window, cache_bytes=DEFAULT_CACHE_BYTES)
    plan = simplans.PublishedPlan(0.0, np.arange(len(world)))
    ts, predicted = cutter.tileset(0, plan, shape.m, shape.n, shape.k)
    def fleet(ids):
        return fleet_of(ids, world.index, world.declared, DEFAULT_CACHE_BYTES)

    dealer = Dealer(policy)
    dealer.set_fleet(fleet(world.ids), 0.0)
    run = OneGemm(ts, 0.0, dealer, world.index, world.actual, world.leave_at if leave_at is None else leave_at,
                  np.zeros((len(world), 3)), fleet, 1, plans, fan_out=fan_out)
    return run, run.run(), predicted


def assert_done_once(run, shape):
    assert run.ledger.complete
    led = run.ledger  # the tiles (but those cut into smaller ones when lost) cover the output exactly once
    tiles.check_cover([t for t in led.tiles if t.index not in led.retired], shape.m, shape.n)
    assert run.out.flops == pytest.approx(2.0 * shape.m * shape.n * shape.k)


def test_an_undisturbed_gemm_takes_what_the_planner_predicts():
    """The scheduler predicts with the PS's dealer on the declared profiles (`predict.dealt_makespan`), so
    an undisturbed GEMM takes exactly its prediction. With fan-out every input leaves the PS once (its
    segments, `fanout.parts`); without, each device's blocks go with its tiles and it takes exactly what
    each device alone with its own pieces takes (`predict.streamed_makespan`, the budget's fallback)."""
    world = World.build(synthetic_fleet(24, seed=1))
    for shape in shapes()[:6]:
        run, shared, predicted = gemm(world, shape)
        assert_done_once(run, shape)
        assert shared.span == pytest.approx(predicted, rel=1e-9)
        run, out, _ = gemm(world, shape, fan_out=False)
        assert_done_once(run, shape)
        boxes = [(t.r0, t.r1, t.c0, t.c1) for t in run.ts.tiles]  # pieces already: sent whole, 4 in flight
        alone = predict.streamed_makespan(boxes, run.ts.owners, {d.id: d.profile for d in world.fleet(
            np.arange(len(world))).devices()}, shape.k, 2, shape.m, shape.n, 1, 4)
        assert out.span == pytest.approx(alone, rel=1e-9)
        assert out.resent == out.duplicates == out.copied == 0
        assert shared.ps_bytes < out.ps_bytes and shared.resent == 0
        assert shared.ps_bytes == pytest.approx((shape.m + shape.n) * shape.k * run.ts.b, rel=0.02)


@pytest.mark.parametrize("seed", range(6))
def test_lost_devices_never_lose_a_tile(seed):
    rng = np.random.default_rng(seed)
    world = World.build(synthetic_fleet(20, seed=seed), stragglers=0.2, hidden_stragglers=True, seed=seed)
    shape = shapes()[0]
    tile = [None, (64, 64)][seed % 2]
    _, clean, _ = gemm(world, shape, tile=tile, policy=PsPolicy(window=1 + seed % 2))
    leave_at = np.full(len(world), math.inf)
    gone = rng.choice(sorted(clean.last), size=8, replace=False)  # devices that had work: each leaves midway
    leave_at[gone] = [clean.last[i] * rng.uniform(0.1, 0.9) for i in gone.tolist()]
    later = float(leave_at[gone].max()) + [0.01, 2.0][seed % 2]  # the new plan drops them, or comes late
    plans = [(later, tuple(w for i, w in enumerate(world.ids) if i not in set(gone.tolist())))]
    run, out, _ = gemm(
        world, shape, tile=tile, policy=PsPolicy(window=1 + seed % 2), leave_at=leave_at, plans=plans
    )
    assert_done_once(run, shape)
    assert out.resent + out.copied >= 1  # re-sent when noticed, or copied first because it ran late
    assert all(r.done_at is not None and not r.tiles for r in out.recoveries)
    assert all(out.last.get(i, 0.0) <= leave_at[i] for i in gone.tolist())  # nothing comes back from the gone


def test_a_suspect_straggler_is_dealt_again_only_after_its_link_check(monkeypatch):
    """A hidden straggler misses its deadline and is suspect; when its retry comes the simulated PS checks
    its link (a round trip over its downlink) and deals it tiles again only once the check is back."""
    proved = []
    real = Dealer.proved

    def proving(self, worker, now):
        proved.append((worker, now))
        return real(self, worker, now)

    monkeypatch.setattr(Dealer, "proved", proving)
    world = World.build(synthetic_fleet(20, seed=0), stragglers=0.3, hidden_stragglers=True, seed=0)
    policy = PsPolicy(window=1, tile_timeout_s=0.02, suspect_retry=1.0)
    run, out, _ = gemm(world, shapes()[0], tile=(64, 64), policy=policy)
    assert_done_once(run, shapes()[0])
    (rec,) = out.recoveries
    (worker, at), = proved
    d = world.index[worker]
    assert worker == rec.worker and at >= rec.detected_at + policy.tile_timeout_s + 2 * world.actual.lat[d]


def test_recovery_over_a_step_weighs_every_gemm_kind_by_its_time():
    world = World.build(synthetic_fleet(24, seed=2))
    sim = Simulation(world, shapes(), 2, policy=PsPolicy(window=1))
    rec = recovery_over_step(sim, shapes())
    kinds = {(s.m, s.n, s.k) for s in shapes()}
    assert len(rec["per_gemm"]) == len(kinds)  # one loss per distinct GEMM kind
    assert min(rec["per_gemm"].values()) <= rec["recovery_s"] <= rec["worst_s"]
    assert rec["worst_s"] == max(rec["per_gemm"].values()) > 0
    assert rec["worst"]["tiles_lost"] >= 1 and rec["worst"]["gemm_s"] > 0


def test_a_step_with_churn_computes_every_flop_once():
    world = World.build(synthetic_fleet(30, seed=3), churn_per_hour=400.0, stragglers=0.1, seed=3)
    sim = Simulation(world, shapes(), 2, policy=PsPolicy(window=2), replan_every_s=1.0)
    stats = sim.step()
    assert stats.flops == pytest.approx(sum(s.flops * s.count_per_step for s in shapes()))
    assert stats.recoveries and stats.resent >= 1
    assert len(world) > 30  # devices joined, and some of them were planned
    assert any(len(p.members) != 30 for p in sim.scheduler.plans)


@pytest.mark.slow  # ~10-25 s a seed (every plan of the churn cut anew); the default run keeps the undisturbed case
@pytest.mark.parametrize("seed", range(3))
def test_deferred_weight_gradients_compute_every_flop_once_under_churn(seed):
    """The backward dealt as the PS's `deferred_gemms` does it (weight gradients beside the input gradients)
    loses nothing when devices leave and join mid-pass, and applies the plans that arrive meanwhile."""
    world = World.build(synthetic_fleet(30, seed=seed), churn_per_hour=400.0, stragglers=0.1, seed=seed)
    sim = Simulation(world, shapes(), 2, policy=PsPolicy(window=2), replan_every_s=1.0, deferred=[1, 8, 2][seed])
    for _ in range(2):
        stats = sim.step()
        assert stats.flops == pytest.approx(sum(s.flops * s.count_per_step for s in shapes()))
        assert stats.tiles and not sim.dealer.deals  # every GEMM ended with the pass
    assert stats.recoveries and sim.version > 0


def test_deferred_weight_gradients_fill_the_tails_of_the_input_gradients():
    """Undisturbed, dealing each layer's weight gradient beside the input gradients shortens the step (the
    tails of every GEMM are filled), never below the busiest device's own seconds."""
    from cleave.sim.breakdown import step_breakdown

    sh = shapes("opt-125m", 8, 1024)
    world = World.build(synthetic_fleet(32, seed=4))
    one, deferred = (step_breakdown(Simulation(world, sh, 2, deferred=d)) for d in (0, 8))
    assert deferred["busiest_device_s"] <= deferred["step_s"] < 0.95 * one["step_s"]
    assert deferred["device_idle_share"] < one["device_idle_share"]
    assert sum(k["count"] for k in deferred["kinds"].values()) == sum(s.count_per_step for s in sh)


def test_backward_pairs_are_the_layers_input_and_weight_gradients():
    sh = shapes()
    pairs = backward_pairs(sh, step_order(sh))
    assert len(pairs) == sum(s.count_per_step for s in sh if s.name.endswith(".dx"))
    for dx, dw in pairs:
        assert sh[dx].name[:-3] == sh[dw].name[:-3] and sh[dx].name.endswith(".dx")


def test_the_step_runs_every_gemm_in_order():
    sh = shapes()
    order = step_order(sh)
    assert len(order) == sum(s.count_per_step for s in sh)
    assert sh[order[0]].name.endswith(".fwd") and sh[order[-1]].name.endswith((".dx", ".dw"))


def test_simulate_step_takes_declared_profiles():
    prof = {
        f"w{i}": DeviceProfile(
            flops=2e9 * (i + 1),
            memory_bytes=64 * 2**20,
            downlink_bytes_per_s=50e6,
            uplink_bytes_per_s=20e6,
            latency_s=0.002,
        )
        for i in range(4)
    }
    sh = gemm_shapes(PRESETS["tiny"], 8, 64)
    t = simulate_step(prof, sh, 4)
    assert t > 0
    assert simulate_step(prof, sh, 4, ps_overhead_s=1.5) == pytest.approx(t + 1.5)
    assert simulate_step(prof, sh, 4, planner="uniform", steps=2) > 0


def test_baselines_refuse_what_memory_forbids():
    work = Workload.of("opt-66b", 128, 1024)
    doc = compare(SimConfig(model="opt-66b", devices=512, systems=("asteroid", "pipeline", "dtfm")))
    for name, r in doc["systems"].items():
        assert r["feasible"] is False and r["step_s"] is None and r["recovery_s"] is None, name
        assert r["memory_bytes"] > 512 * 2**20 and r["unconstrained_step_s"] > 0
    assert work.params > 65e9
    roomy = compare(
        SimConfig(
            model="opt-125m",
            devices=64,
            memory_bytes=64 * 2**30,
            systems=("alpa", "dp_tp", "dtfm", "asteroid", "pipeline"),
        )
    )
    assert all(r["feasible"] and r["step_s"] > 0 for r in roomy["systems"].values())
    assert roomy["systems"]["asteroid"]["devices_used"] <= 32  # 8 stages x 4 samples a micro-batch


def test_cleave_traffic_per_device_falls_as_devices_join():
    """Per-device traffic falls as devices join; so does the step while the PS's link is not the limit (here
    unlimited: at the default link its egress, which grows with the fleet, sets the step as the fleet grows)."""
    rows = []
    for n in (16, 32, 64, 128):
        r = compare(SimConfig(model="opt-125m", devices=n, batch=16, seq=256, systems=("cleave",), ps_bandwidth=None))[
            "systems"
        ]["cleave"]
        rows.append((r["per_device_down_bytes"], r["per_device_up_bytes"], r["step_s"]))
    for before, after in zip(rows, rows[1:], strict=False):
        assert after[0] < before[0] and after[1] < before[1] and after[2] < before[2]


@pytest.mark.slow  # ~10 s
def test_a_seed_fixes_the_simulation():
    def run(seed):
        cfg = SimConfig(
            model="opt-125m",
            devices=16,
            batch=8,
            seq=128,
            churn=200.0,
            replan_every_s=20.0,
            stragglers=0.2,
            hidden_stragglers=True,
            seed=seed,
            systems=("cleave", "asteroid"),
        )
        doc = compare(cfg)
        doc["systems"]["cleave"].pop("sim_wall_s")
        return json.dumps(doc, sort_keys=True, default=float)

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_expected_step_under_churn_for_a_baseline():
    assert expected_step(100.0, 50.0, 0.01) == pytest.approx(100.0 / 0.5)
    assert expected_step(100.0, 50.0, 0.05) is None  # a failure comes before it has recovered
    r = SystemResult("x", True, 100.0, 50.0, 1.0, 1.0, 36)  # 36 devices at 1 leave per device-hour: 0.01/s
    assert with_churn(r, 1.0).extra["step_s_with_churn"] == pytest.approx(200.0)


def cli(argv, capsys):
    parser = argparse.ArgumentParser()
    sim_cmd.register(parser.add_subparsers(dest="command"))
    assert sim_cmd.run(parser.parse_args(["sim", *argv])) == 0
    return capsys.readouterr().out


def test_cli_json_has_every_system(capsys):
    doc = json.loads(
        cli(["--model", "opt-125m", "--devices", "32", "--batch", "8", "--seq", "128", "--json"], capsys)
    )
    assert set(doc["systems"]) == {"cleave", "alpa", "dp_tp", "dtfm", "asteroid", "pipeline"}
    for r in doc["systems"].values():
        assert {"step_s", "feasible", "recovery_s", "per_device_down_bytes", "per_device_up_bytes"} <= set(r)
    assert "cleave" in cli(["--model", "opt-125m", "--devices", "16", "--batch", "8", "--seq", "128"], capsys)


@pytest.mark.slow  # ~9 s (the report's JSON points: test_cli_json_has_every_system)
def test_cli_report_writes_json_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = json.loads(
        cli(
            [
                "--model",
                "opt-125m",
                "--devices",
                "16",
                "--batch",
                "8",
                "--seq",
                "128",
                "--report",
                str(tmp_path),
                "--report-models",
                "opt-125m",
                "--report-devices",
                "16,32",
            ],
            capsys,
        )
    )
    names = {p.split("/")[-1] for p in out["files"]}
    assert {
        "report.json",
        "step_vs_devices.png",
        "largest_fleet.png",
        "traffic_vs_devices.png",
        "recovery.png",
        "churn.png",
    } <= names
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["claims"]["traffic"]["opt-125m"]["falls_as_devices_join"] is True
    assert {(r["devices"], r["churn"]) for r in doc["churn"]} == {(16, rate) for rate in CHURN_RATES}
    bill = {r["devices"]: r for r in doc["claims"]["ps"]}
    assert set(bill) == {16, 32} and all(r["bound"] in ("fleet", "ps_egress", "ps_compute", "ps_memory")
                                         for r in bill.values())
