"""A resumed PS on a real nats-server tells the events stream each step line (and its recovery events) once, and
the monitor, replaying that stream, counts each step once: also where the PS has no metrics file and tells its
last commit's lines again."""

from __future__ import annotations

import json

import pytest
from torch import nn

from cleave import bus as busmod
from cleave.runtime.faults import Faults
from cleave.schemas import EVENTS_STREAM, Event, StepMetrics
from cleave.train.job import JobConfig
from cleave_monitor.core import MonitorState
from cleave_monitor.hub import Hub
from cleave_monitor.main import Feed
from cleave_ps.settings import PsSettings
from cleave_ps.state.persist import Progress, snapshot

JOB = JobConfig(job_id="told", preset="tiny", steps=6, batch_size=2, seq_len=16)
LOST = Event(kind="recovered", at=1003.5, step=3, worker_id="w-1", cause="heartbeat_timeout")


def line(step: int) -> StepMetrics:
    recovery = (LOST,) if step == 3 else ()
    return StepMetrics(job=JOB.job_id, step=step, loss=5.0, step_time_s=0.1, workers=1, tiles=4, tokens=32,
                       recoveries=len(recovery), recovery=recovery, at=1000.0 + step)


async def incarnation(url: str, s: PsSettings, model: nn.Module) -> Progress:
    """A PS starting: it claims its epoch and resumes the job (a new job: from step 0)."""
    ps = Progress(await busmod.connect(url, "ps"), JOB, s, Faults(""))
    await ps.bus.setup()
    await ps.open()
    await ps.resume(model, None)
    return ps


async def told(bus: busmod.Bus) -> list[tuple[str, bytes]]:
    """The events stream, first message to last: (subject, frame)."""
    last = (await bus.js.stream_info(EVENTS_STREAM)).state.last_seq
    return [((m := await bus.js.get_msg(EVENTS_STREAM, seq)).subject, m.data) for seq in range(1, last + 1)]


@pytest.mark.parametrize("has_file", [True, False], ids=["metrics_file", "no_metrics_file"])
async def test_a_resumed_ps_tells_each_step_once_and_the_monitor_counts_each_once(nats_url, tmp_path, has_file):
    s = PsSettings(metrics_out=tmp_path / "m.jsonl" if has_file else None, persist_every=2)
    model = nn.Linear(4, 4)
    ps = await incarnation(nats_url, s, model)
    for last in (1, 3):  # steps 0-3 committed and reported
        await ps.commit(snapshot(model, None, JOB.job_id, last, ps.epoch), (line(last - 1), line(last)))
    await ps.bus.close()
    ps = await incarnation(nats_url, s, model)  # resumed after step 3: its lines were reported
    await ps.persister.commit(snapshot(model, None, JOB.job_id, 5, ps.epoch), (line(4), line(5)))
    await ps.bus.close()  # ... and killed after committing steps 4-5, before reporting them
    ps = await incarnation(nats_url, s, model)  # resumed after step 5: reports them
    try:
        stream = await told(ps.bus)
    finally:
        await ps.bus.close()
    subjects = [subject.split(".")[2] for subject, _ in stream]  # (cleave.events.<kind>.<job>)
    assert subjects.count("ps_resumed") == 2
    if has_file:
        assert subjects.count("metrics") == 6 and subjects.count("recovered") == 1  # each told once
        assert [json.loads(x)["step"] for x in s.metrics_out.read_text().splitlines()] == list(range(6))
    else:  # no file: the PS cannot know what it told, and tells steps 2-3 again at its first resume
        assert subjects.count("metrics") == 8 and subjects.count("recovered") == 2
    state = MonitorState()
    feed = Feed(state, Hub())
    for subject, data in stream:  # as the monitor replays the stream
        feed.on_stream_message(subject, data)
    assert [p["step"] for p in state.series(JOB.job_id)] == list(range(6))
    t = state.totals
    assert (t.steps, t.tiles, t.tokens, t.recoveries) == (6, 24, 192, 1)
    assert t.events["recovered"] == 1 and t.events["ps_resumed"] == 2
