"""DiLoCo and FedAvg pinned to plain training, the round rules, and robust aggregation (no network)."""

from __future__ import annotations

import math

import pytest
import torch

from cleave.errors import ConfigError
from cleave.methods import aggregate, common, diloco, fedavg
from cleave.models import build_model, get_preset
from cleave.train import schedule
from cleave.train.data import Corpus
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer

JOB = JobConfig(preset="tiny", batch_size=4, seq_len=32)
STEPS = 4


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus(JOB.data, JOB.val_fraction)


@pytest.fixture(scope="module")
def reference(corpus: Corpus) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain run: losses of STEPS steps and the final weights."""
    trainer = Trainer(JOB, corpus=corpus)
    losses = [trainer.step(s) for s in range(STEPS)]
    return losses, common.snapshot(dict(trainer.model.named_parameters()))


def fresh(job: JobConfig = JOB) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(get_preset(job.preset), seed=job.seed)
    return model, common.make_adamw(model.parameters(), job)


def assert_matches(reference: tuple[list[float], dict], losses: list[float], params: dict) -> None:
    ref_losses, ref_params = reference
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, p in params.items():
        torch.testing.assert_close(p.detach(), ref_params[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("inner_steps", [1, 2])
def test_diloco_one_worker_lr1_no_momentum_is_plain_training(
    corpus: Corpus, reference, inner_steps: int
) -> None:
    global_model, _ = fresh()
    worker, opt = fresh()
    cfg = diloco.DilocoConfig(inner_steps=inner_steps, outer_lr=1.0, outer_momentum=0.0)
    server = diloco.DilocoServer(common.trainable(global_model), cfg)
    losses: list[float] = []
    for r in range(STEPS // inner_steps):
        batches = schedule.scheduled(  # the inner steps follow the run's lr schedule, as the worker's do
            opt, JOB, r * inner_steps, (common.shard_batch(corpus, JOB, 0, r * inner_steps + h) for h in range(inner_steps))
        )
        delta, got = diloco.worker_round(
            worker, opt, server.global_state(), batches, inner_steps, JOB.grad_clip
        )
        assert server.submit("w0", server.round, delta, weight=1.0) == "accepted"
        assert server.close_round().applied
        losses += got
    assert_matches(reference, losses, common.trainable(global_model))


def test_fedavg_one_client_one_step_is_plain_training(corpus: Corpus, reference) -> None:
    global_model, _ = fresh()
    client, opt = fresh()
    server = fedavg.FedAvgServer(common.trainable(global_model), fedavg.FedAvgConfig(local_steps=1))
    losses: list[float] = []
    for r in range(STEPS):
        up = fedavg.client_update(
            client, opt, server.global_state(), schedule.scheduled(opt, JOB, r, [common.shard_batch(corpus, JOB, 0, r)]),
            1, JOB.grad_clip,
        )
        assert up.samples == JOB.batch_size
        server.submit("c0", r, up.delta, up.samples)
        server.close_round()
        losses += up.losses
    assert_matches(reference, losses, common.trainable(global_model))


@pytest.mark.parametrize("method,precision", [("fedavg", "bf16"), ("diloco", "fp16")])
def test_half_precision_rounds_equal_the_same_precision_reference(corpus: Corpus, method: str, precision: str) -> None:
    """One worker, one local step: the round methods in bf16 or fp16 are the reference run in that precision
    (autocast, the GEMMs rounded once, fp16's loss scale)."""
    job = JOB.model_copy(update={"precision": precision})
    trainer = Trainer(job, corpus=corpus)
    want = [trainer.step(s) for s in range(STEPS)]
    global_model, _ = fresh(job)
    worker, opt = fresh(job)
    common.use_precision(worker, precision)
    params = common.trainable(global_model)
    server = (fedavg.FedAvgServer(params, fedavg.FedAvgConfig(local_steps=1)) if method == "fedavg" else
              diloco.DilocoServer(params, diloco.DilocoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0)))
    losses: list[float] = []
    for r in range(STEPS):
        batches = schedule.scheduled(opt, job, r, [common.shard_batch(corpus, job, 0, r)])
        if method == "fedavg":
            up = fedavg.client_update(worker, opt, server.global_state(), batches, 1, job.grad_clip, precision)
            d, got = up.delta, list(up.losses)
        else:
            d, got = diloco.worker_round(worker, opt, server.global_state(), batches, 1, job.grad_clip, precision)
        server.submit("w0", r, d, 1.0)
        assert server.close_round().applied
        losses += got
    assert losses == pytest.approx(want, rel=1e-5)
    ref = dict(trainer.model.named_parameters())
    for k, p in params.items():
        torch.testing.assert_close(p.detach(), ref[k].detach(), rtol=1e-4, atol=1e-5, msg=k)
    if precision == "fp16":
        assert opt.param_groups[0]["loss_scale"] == trainer.opt.param_groups[0]["loss_scale"]


def toy(value: float = 0.0) -> dict[str, torch.nn.Parameter]:
    return {"w": torch.nn.Parameter(torch.full((3,), value)), "b": torch.nn.Parameter(torch.zeros(()))}


def first(params: dict[str, torch.nn.Parameter]) -> float:
    return float(params["w"].detach()[0])


def delta(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3,), v), "b": torch.tensor(v)}


def test_diloco_outer_step_is_weighted_nesterov() -> None:
    params = toy(1.0)
    server = diloco.DilocoServer(params, diloco.DilocoConfig(outer_lr=0.5, outer_momentum=0.9))
    server.submit("a", 0, delta(1.0), 1.0)
    server.submit("b", 0, delta(3.0), 3.0)
    server.close_round()
    g1, theta = (1 + 9) / 4, 1.0
    buf = g1
    theta -= 0.5 * (g1 + 0.9 * buf)  # Nesterov: step along g + mu * buf
    assert first(params) == pytest.approx(theta)
    server.submit("a", 1, delta(2.0), 1.0)
    server.close_round()
    buf = 0.9 * buf + 2.0
    theta -= 0.5 * (2.0 + 0.9 * buf)
    assert first(params) == pytest.approx(theta)
    state = server.state_dict()
    again = diloco.DilocoServer(toy(theta), diloco.DilocoConfig(outer_lr=0.5, outer_momentum=0.9))
    again.load_state_dict(state)
    assert again.round == 2
    assert torch.equal(again.opt.state_dict()["state"][0]["momentum_buffer"], torch.full((3,), buf))


def test_round_rules_late_duplicate_future_and_bad_updates() -> None:
    server = diloco.DilocoServer(toy(), diloco.DilocoConfig(outer_lr=1.0, outer_momentum=0.0))
    assert server.submit("a", 0, delta(1.0), 1.0) == "accepted"
    assert server.submit("a", 0, delta(5.0), 1.0) == "duplicate"
    assert server.submit("a", 1, delta(1.0), 1.0) == "future"
    assert server.submit("b", 0, {"w": torch.zeros(4), "b": torch.tensor(0.0)}, 1.0) == "rejected"
    assert server.submit("b", 0, {"w": torch.zeros(3)}, 1.0) == "rejected"
    assert server.submit("b", 0, delta(float("nan")), 1.0) == "rejected"
    assert server.submit("b", 0, delta(1.0), -1.0) == "rejected"
    report = server.close_round()
    assert report.applied and report.senders == ("a",)
    assert report.counts == {"accepted": 1, "duplicate": 1, "future": 1, "rejected": 4}
    assert server.submit("b", 0, delta(1.0), 1.0) == "late"  # max_staleness 0: dropped
    assert first(server.params) == -1.0


def test_late_updates_fold_in_with_staleness_weight() -> None:
    params = toy()
    server = fedavg.FedAvgServer(params, fedavg.FedAvgConfig(max_staleness=1))
    server.submit("a", 0, delta(1.0), 10)
    server.close_round()
    assert server.submit("slow", 0, delta(4.0), 10) == "accepted"  # weight 10 / 2
    assert server.submit("a", 1, delta(1.0), 10) == "accepted"
    report = server.close_round()
    assert report.late_folded == 1 and report.senders == ("a", "slow")
    assert first(params) == pytest.approx(1.0 + (4.0 * 5 + 1.0 * 10) / 15)
    assert server.submit("slow", 0, delta(4.0), 10) == "late"  # two rounds old: past max_staleness


def test_leavers_and_empty_rounds() -> None:
    params = toy(2.0)
    server = fedavg.FedAvgServer(params, fedavg.FedAvgConfig(min_updates=2))
    server.submit("a", 0, delta(1.0), 1)
    assert not server.collector.complete({"a", "b"}) and server.collector.complete({"a"})
    # "b" left: the deadline closes the round with one update, under min_updates
    report = server.close_round()
    assert not report.applied and report.round == 0 and server.round == 1
    assert first(params) == 2.0
    server.submit("a", 1, delta(1.0), 1)
    server.submit("c", 1, delta(3.0), 1)
    assert server.close_round().applied
    assert first(params) == 4.0


def honest_and_malicious(n_honest: int = 6) -> tuple[list[dict], list[float]]:
    g = torch.Generator().manual_seed(0)
    deltas = [{"w": 1.0 + 0.01 * torch.randn(100, generator=g)} for _ in range(n_honest)]
    deltas.append({"w": torch.full((100,), -1e6)})  # a malicious client, claiming a large sample count
    return deltas, [1.0] * n_honest + [1000.0]


def test_median_and_trimmed_mean_neutralise_an_outlier() -> None:
    deltas, weights = honest_and_malicious()
    mean = aggregate.aggregate(deltas, weights, "mean")["w"]
    assert float(mean.max()) < -1e5  # one client ruins the weighted mean
    for rule in ("median", "trimmed"):
        agg = aggregate.aggregate(deltas, weights, rule, trim=0.2)["w"]
        torch.testing.assert_close(agg, torch.ones(100), atol=0.03, rtol=0, msg=rule)


def test_robust_rules_on_known_values() -> None:
    vals = [{"x": torch.tensor([v])} for v in (5.0, 1.0, 100.0, 2.0)]
    assert aggregate.aggregate(vals, [1] * 4, "median")["x"].item() == 3.5  # mean of the two middles
    assert aggregate.aggregate(vals, [1] * 4, "trimmed", trim=0.25)["x"].item() == 3.5
    assert aggregate.aggregate(vals, [1] * 4, "trimmed", trim=0.0)["x"].item() == 27.0
    assert aggregate.aggregate(vals, [1, 0, 0, 1], "mean")["x"].item() == 3.5
    with pytest.raises(ConfigError):
        aggregate.aggregate(vals, [1] * 4, "krum")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        diloco.DilocoConfig(outer_momentum=1.0)


def test_a_rounds_loss_is_combined_as_its_updates_are() -> None:
    """The loss a round reported was the mean of the losses its senders claim: one sender claiming NaN made every
    round's loss NaN (also under the median), one claiming 1e30 made it 1e30."""
    honest = [3.1, 3.2, 3.3, 3.4, 3.5]
    assert aggregate.round_loss(honest, "mean") == pytest.approx(3.3)
    assert aggregate.round_loss([*honest, math.nan, math.inf], "mean") == pytest.approx(3.3)
    assert aggregate.round_loss([*honest, 1e30], "median") == pytest.approx(3.35)
    assert aggregate.round_loss([*honest, 1e30, -1e30], "trimmed", trim=0.2) == pytest.approx(3.3)
    assert math.isnan(aggregate.round_loss([math.nan], "median")) and math.isnan(aggregate.round_loss([], "mean"))


def test_fedavg_with_robust_rule_trains_through_a_malicious_client(corpus: Corpus) -> None:
    global_model, _ = fresh()
    clients = [fresh() for _ in range(3)]
    server = fedavg.FedAvgServer(
        common.trainable(global_model), fedavg.FedAvgConfig(local_steps=2, rule="median")
    )
    val = common.shard_batch(corpus, JOB, 99, 0)
    before = common.lm_loss(global_model, *val).item()
    for r in range(2):
        state = server.global_state()
        for i, (model, opt) in enumerate(clients):
            batches = (common.shard_batch(corpus, JOB, i + 1, r * 2 + e) for e in range(2))
            up = fedavg.client_update(model, opt, state, batches, 2, JOB.grad_clip)
            server.submit(f"c{i}", r, up.delta, up.samples)
        server.submit("evil", r, {k: torch.randn_like(v) * 100 for k, v in state.items()}, 10**6)
        assert server.close_round().applied
    with torch.no_grad():
        assert common.lm_loss(global_model, *val).item() < before - 0.3


def test_a_round_with_no_accepted_update_runs_again_and_clipping_bounds_the_norm() -> None:
    from cleave.methods.aggregate import clip_update, norm

    params = toy(2.0)
    server = fedavg.FedAvgServer(params, fedavg.FedAvgConfig())
    assert server.submit("a", 0, delta(float("nan")), 1) == "rejected"
    report = server.close_round()
    assert not report.applied and report.senders == () and server.round == 0  # not a round: it runs again
    assert server.submit("a", 0, delta(1.0), 1) == "accepted"
    assert server.close_round().applied and server.round == 1
    clipped, before = clip_update({"w": torch.full((4,), 3.0)}, 2.0)
    assert before == pytest.approx(6.0) and norm(clipped) == pytest.approx(2.0)
    same, _ = clip_update({"w": torch.ones(4)}, 5.0)
    assert torch.equal(same["w"], torch.ones(4))


def test_lora_adapts_the_layers_of_a_half_precision_model() -> None:
    """The PS's model of a bf16 LoRA job has tiled linear layers (the reference's GEMMs): they get adapters too,
    and start out computing the base model."""
    from cleave.methods.lora import attach_for_job

    job = JobConfig(preset="tiny", method="fedavg", lora_rank=4, precision="bf16", batch_size=2, seq_len=16)
    trainer = Trainer(job)
    x, _ = trainer.corpus.batch(0, 0, 2, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # as the Trainer and workers run it
        before = trainer.model(x)
        attach_for_job(trainer.model, job)
        assert torch.equal(trainer.model(x), before)
    assert all(k.endswith((".lora_A", ".lora_B")) for k in common.trainable(trainer.model))
