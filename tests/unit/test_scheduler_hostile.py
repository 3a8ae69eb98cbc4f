"""The scheduler's defences, without a bus: probes answered only on the prober's own inbox and within its
budget, profiles that overclaim corrected to what the PS saw delivered, a silent worker's claimed link adding
little to its liveness, and a device that breaks the planner dropped while the others are planned."""

from __future__ import annotations

import pytest

from cleave.schemas import DeviceProfile, Heartbeat, Observed, Probe, WorkerObserved
from cleave_scheduler.main import Scheduler
from cleave_scheduler.outbox import Outbox
from cleave_scheduler.probes import ProbeDesk, prober, refusal
from cleave_scheduler.registry import HYSTERESIS, OVERCLAIM, TILE_OVERHEAD_S, Registry
from cleave_scheduler.settings import SchedulerSettings
from cleave_scheduler.synthetic import job_shapes

FAST = DeviceProfile(flops=1e12, memory_bytes=1 << 30, downlink_bytes_per_s=1e8, uplink_bytes_per_s=1e8,
                     latency_s=0.001)


def beat(worker: str, profile: DeviceProfile = FAST) -> Heartbeat:
    return Heartbeat(worker_id=worker, profile=profile, sent_at=1.0, started_at=0.0)


@pytest.mark.parametrize("reply, ok", [
    ("_INBOX.worker.w1.abc.1", True),
    ("_INBOX.worker.w2.abc.1", False),  # another worker's inbox
    ("$KV.cleave-plans.current", False),  # a plan key
    ("$JS.API.STREAM.PURGE.KV_cleave-registry", False),  # the JetStream API
    ("_INBOX.worker.w1.", False),
    ("_INBOX.worker.w1.*", False),
    ("", False),
])
def test_a_probe_is_answered_only_on_its_senders_inbox(reply: str, ok: bool) -> None:
    assert (refusal("cleave.probe.w1", reply) == "") is ok
    assert refusal("cleave.probe", "_INBOX.worker.w1.abc.1")  # an older worker's probe names no sender
    assert prober("cleave.probe.w1") == "w1" and prober("cleave.hb.w1") == ""


def test_each_worker_draws_echoes_within_its_budget() -> None:
    desk = ProbeDesk(max_payload=8 << 20, burst=10 << 20, rate=1 << 20)
    big = Probe(reply_bytes=4 << 20)
    assert desk.answer(big, "w1", 0.0) and desk.answer(big, "w1", 0.0)
    assert desk.answer(big, "w1", 0.0) is None and desk.refused == 1  # 12 MiB asked of a 10 MiB burst
    assert desk.answer(big, "w2", 0.0)  # another worker's budget is its own
    assert desk.answer(big, "w1", 3.0)  # refilled at 1 MiB/s
    assert len(desk.answer(Probe(reply_bytes=64), "w1", 3.0).payload) == 64


def test_all_echoes_together_stay_within_one_budget_whatever_ids_are_claimed() -> None:
    """Every probe from a fresh id (the shared credential lets a worker claim any): over any t seconds the
    echoes sent hold at most the burst + rate x t + one echo. A refusable probe is told when to ask again;
    a large echo waits its turn, not for small ones to stop; an echo of nothing never waits."""
    burst, rate, big = 16 << 20, 4 << 20, Probe(reply_bytes=4 << 20, refusable=True)
    desk = ProbeDesk(max_payload=8 << 20, total_burst=burst, total_rate=rate)
    sent, t = 0, 0.0
    for i in range(4000):  # 4 MiB asked by a fresh id every millisecond for 4 s
        t = i / 1000
        echo = desk.answer(big, f"fresh{i}", t)
        sent += len(echo.payload)
        assert sent <= burst + rate * t + (4 << 20)
        assert echo.payload or 0 < echo.retry_after_s <= 1.0  # refused: ask again once 4 MiB/s refilled it
    assert sent >= burst + rate * 3.9 and desk.refused_total > 3900 and desk.refused == 0
    assert desk.answer(Probe(refusable=True), "fresh-latency", t).retry_after_s == 0  # 64 B echoes: answered
    assert desk.answer(Probe(payload=bytes(1 << 20), refusable=True), "up", t).retry_after_s == 0  # uploads too
    assert desk.answer(Probe(reply_bytes=4 << 20), "older-worker", t) is None  # not refusable: no answer
    # in debt, the first to ask once it is paid off gets its echo, 4 MiB as well as 64 KiB
    wait = desk.answer(big, "late", t).retry_after_s
    assert len(desk.answer(big, "late", t + wait).payload) == 4 << 20
    # and a worker over its own budget is told so, with the wait its own refill needs
    own = ProbeDesk(max_payload=8 << 20, burst=6 << 20, rate=1 << 20)
    assert own.answer(big, "w1", 0.0).payload and own.answer(big, "w1", 0.0).retry_after_s == pytest.approx(2.0)


def test_refused_echoes_are_told_once_a_minute_while_there_are_new_ones() -> None:
    """The operator's log says that workers wait to measure their links (a flood, or budgets too tight), at most
    once a minute and only when something new was refused."""
    desk, big = ProbeDesk(max_payload=8 << 20, total_burst=4 << 20, total_rate=1 << 20), Probe(reply_bytes=4 << 20)
    assert desk.answer(big, "a", 0.0).payload and desk.news(0.0) is None  # nothing refused yet
    assert desk.answer(big, "b", 0.0) is None
    # ... naming who drew the echoes since it last told (a flood's ids), with how many ids drew any
    assert desk.news(0.0) == {"over_worker_budget": 0, "over_total_budget": 1, "drawn_by": 1,
                              "top_drawers": {"a": 4 << 20}}
    assert desk.answer(big, "c", 0.0) is None  # (the budget still in debt)
    for t, worker in ((30.0, "d"), (40.0, "e"), (50.0, "d")):
        assert desk.answer(Probe(reply_bytes=1 << 20), worker, t).payload
    assert desk.news(1.0) is None and desk.news(60.0) == {"over_worker_budget": 0, "over_total_budget": 2,
                                                          "drawn_by": 2, "top_drawers": {"d": 2 << 20, "e": 1 << 20}}
    assert desk.news(500.0) is None  # nothing new since


def test_a_profile_claiming_far_more_than_its_worker_delivers_is_corrected() -> None:
    reg = Registry(liveness_s=1.0)
    reg.heartbeat(beat("liar"), 0.0)
    reg.heartbeat(beat("honest"), 0.0)
    allowed = 1.0 + 20 * TILE_OVERHEAD_S  # 20 tiles, predicted 1 s in all
    report = Observed(job="j", at=1.0, workers=(
        WorkerObserved(worker_id="liar", tiles=20, observed_s=100 * allowed, predicted_s=1.0, flops=FAST.flops),
        WorkerObserved(worker_id="honest", tiles=20, observed_s=2.0, predicted_s=1.0, flops=FAST.flops),
        WorkerObserved(worker_id="stranger", tiles=20, observed_s=100.0, predicted_s=1.0, flops=FAST.flops)))
    assert reg.observe(report) == [("liar", 1.0, pytest.approx(100.0))]  # 2x is not far more; strangers ignored
    liar = reg.devices["liar"].profile
    assert liar.flops == pytest.approx(FAST.flops / 100)
    assert liar.uplink_bytes_per_s == pytest.approx(FAST.uplink_bytes_per_s / 100)
    assert liar.latency_s == FAST.latency_s and reg.devices["honest"].profile == FAST
    reg.heartbeat(beat("liar"), 2.0)  # it keeps claiming: it keeps being planned as what it delivers
    assert reg.devices["liar"].profile == liar
    # observed on its corrected profile: as predicted now, or within HYSTERESIS of it, nothing changes ...
    for observed in (allowed, 1.5 * allowed, allowed / 1.5):
        same = WorkerObserved(worker_id="liar", tiles=20, observed_s=observed, predicted_s=1.0, flops=liar.flops)
        assert reg.observe(Observed(job="j", at=3.0, workers=(same,))) == []
    # ... and once it delivers what it claims again, its claim stands again
    better = WorkerObserved(worker_id="liar", tiles=20, observed_s=0.01, predicted_s=1.0, flops=liar.flops)
    assert reg.observe(Observed(job="j", at=4.0, workers=(better,))) == [("liar", pytest.approx(100.0), 1.0)]
    assert reg.devices["liar"].profile == FAST and OVERCLAIM > HYSTERESIS


def test_a_claimed_slow_link_adds_at_most_a_few_seconds_to_liveness() -> None:
    reg = Registry(liveness_s=1.0, link_grace_s=5.0)
    slow = FAST.model_copy(update={"latency_s": 10.0, "uplink_bytes_per_s": 1e3})  # a minute, by its claim
    reg.heartbeat(beat("ghost", slow), 0.0)
    assert reg.sweep(5.9) == [] and reg.sweep(6.1) == ["ghost"]


async def test_a_device_that_breaks_the_planner_is_dropped_and_the_rest_planned() -> None:
    """The planner failing with anything but PlanError (a bug no bound on profiles caught) costs the fleet one
    device: the new one whose absence lets it plan; the scheduler goes on, and refuses it until it changes."""

    class Fragile(Scheduler):  # the real planner, made to fail on one profile, as a bug would
        async def _lay_out(self, plan):  # noqa: ANN001, ANN202
            if any(w.profile.flops == 123e9 for w in plan.workers):
                raise ZeroDivisionError("a planner bug")
            return await super()._lay_out(plan)

    sched = Fragile(SchedulerSettings(), bus=None)
    sched.outbox = Outbox(None, None)
    sched.shapes = job_shapes("tiny", 8, 64, 4)
    for w in ("a", "b"):
        sched.registry.heartbeat(beat(w), 0.0)
    assert (await sched.make_plan("start")).gemms
    odd = FAST.model_copy(update={"flops": 123e9})
    sched.registry.heartbeat(beat("odd", odd), 1.0)
    plan = await sched.make_plan("join")
    assert plan.gemms and {w.worker_id for w in plan.workers} == {"a", "b"}
    assert "odd" not in sched.registry.devices and sched.outbox.records == {"odd": None}
    assert any(e.kind == "worker_dropped" and e.worker_id == "odd" for e in sched.outbox.events)
    assert await sched.on_heartbeat(beat("odd", odd), 0) is None and "odd" not in sched.registry.devices
    await sched.on_heartbeat(beat("odd", FAST), 0)  # a changed profile is heard again
    assert "odd" in sched.registry.devices
    sched.close()


def test_two_processes_under_one_worker_id_are_told_apart_from_a_restart() -> None:
    """Two machines with one credential folder (two `cleave site --name lab-a`) or one --worker-id: their
    heartbeats alternate under one id, and the PS sees one worker that answers twice. A restart switches once."""
    reg = Registry(liveness_s=1.0)

    def at(started: float, now: float) -> tuple[float, float] | None:
        hb = beat("w1").model_copy(update={"started_at": started, "sent_at": now})
        reg.heartbeat(hb, now)
        return reg.shared(hb, now)

    assert [at(100.0, t) for t in (0.0, 0.5, 1.0)] == [None] * 3
    assert [at(200.0, t) for t in (1.5, 2.0, 2.5, 3.0, 6.0, 9.5)] == [None] * 6  # restarted: a new process
    said = [at(started, 10.0 + i / 4) for i, started in enumerate((300.0, 200.0, 300.0, 200.0))]
    assert said == [None, None, (200.0, 300.0), (200.0, 300.0)]  # a second one beside it: said at its 3rd switch
    assert reg.sweep(20.0) == ["w1"] and at(400.0, 20.0) is None  # gone and back: starts afresh
