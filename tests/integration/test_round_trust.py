"""Rounds trust no sender, over a real nats-server with worker processes: an update from a non-member, or from a
member claiming a huge weight, does not move the global weights; members without their own data (for an
own_data job) or without the memory for a round are refused with the reason and not asked again; a job whose
rounds accept nothing fails with exit status 4 and what the PS saw."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from cleave import bus as busmod
from cleave.api.fleet import LocalFleet
from cleave.compression import get_compressor, unpack
from cleave.errors import EXIT_JOB_FAILED, PsEnded
from cleave.schemas import SUBJECT_ROUNDCAST_ALL, SUBJECT_UPDATES, PackedTensors, RoundTask, RoundUpdate
from cleave.train.job import JobConfig
from cleave.train.schedule import lr_at
from cleave.train.trainer import Trainer
from tests.integration.fleet import assert_same

TEXT = "".join(f"line {i}: the site's own notes, which never leave it.\n" for i in range(200))
CALM = {"CLEAVE_SCHEDULER_LIVENESS_S": "5"}  # runs compared member for member: a loaded machine's late
# heartbeats must not drop a worker from a round (the default 1 s does, with several test stacks on 2 cores)


def run(run_dir, job: JobConfig, workers: dict[str, dict[str, str]], timeout_s: float = 240) -> list[dict]:
    """The job on a stack with the named workers (name -> extra environment)."""
    fleet = LocalFleet(run_dir, 0, scheduler_env=CALM)
    try:
        fleet.start()
        for name, env in workers.items():
            fleet.stack.service(name, "worker", ["--worker-id", name], env=env, restart=False)
        fleet.start_ps(job, run_dir / "m.jsonl")
        return fleet.wait_ps(run_dir / "m.jsonl", timeout_s=timeout_s)
    finally:
        fleet.stop()


class Intruder:
    """A process on the bus that is no member: for every round it sees, it sends a huge update as itself
    claiming 1e30 tokens, and one in a member's name on its own subject."""

    def __init__(self, url: str) -> None:
        self.url, self.sent, self.ready = url, 0, threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self.main()), daemon=True)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.done.set)
        self.thread.join(10)

    async def main(self) -> None:
        self.loop, self.done = asyncio.get_running_loop(), asyncio.Event()
        bus = await busmod.connect(self.url, "intruder")

        async def on_round(task: RoundTask, nbytes: int) -> None:
            huge = {k: torch.full_like(t, 1e4) for k, t in unpack(task.weights).items()}
            packed = PackedTensors(tensors={k: get_compressor("none").compress(v) for k, v in huge.items()})
            for claimed in ("intruder", "honest"):
                msg = RoundUpdate(job=task.job, epoch=task.epoch, round=task.round, worker_id=claimed, delta=packed,
                                  weight=1e30, losses=(0.0,))
                subject = SUBJECT_UPDATES.format(job=task.job, epoch=task.epoch, worker_id="intruder")
                await bus.publish(subject, msg)
                self.sent += 1

        sub = await bus.subscribe(SUBJECT_ROUNDCAST_ALL, RoundTask, on_round)
        self.ready.set()
        await self.done.wait()
        await sub.unsubscribe()
        await bus.close()


@pytest.mark.slow  # ~60 s: two runs of the same job
def test_a_non_member_and_a_lying_member_do_not_move_the_global_weights(tmp_path):
    job = JobConfig(job_id="trust", preset="tiny", steps=3, method="fedavg", local_steps=1, round_timeout_s=60)
    workers = {"honest": {}, "liar": {}}
    calm = run(tmp_path / "calm", job, workers)
    fleet_dir = tmp_path / "attacked"
    fleet = LocalFleet(fleet_dir, 0, scheduler_env=CALM)
    try:
        fleet.start()
        intruder = Intruder(fleet.stack.nats_url)
        intruder.thread.start()
        assert intruder.ready.wait(30)
        for name, env in {"honest": {}, "liar": {"CLEAVE_WORKER_LIE_WEIGHT": "1e30"}}.items():
            fleet.stack.service(name, "worker", ["--worker-id", name], env=env, restart=False)
        fleet.start_ps(job, fleet_dir / "m.jsonl")
        attacked = fleet.wait_ps(fleet_dir / "m.jsonl", timeout_s=240)
        intruder.stop()
    finally:
        fleet.stop()
    assert intruder.sent >= 6
    assert [m["workers"] for m in attacked] == [2, 2, 2]
    # the same losses to the last bit: the intruder's updates and the liar's claimed weight changed nothing
    assert [m["loss"] for m in attacked] == [m["loss"] for m in calm]
    log = (fleet_dir / "logs" / "ps.log").read_text()
    assert "not_member" in log and "wrong_sender" in log


@pytest.mark.slow  # ~30 s: four workers
def test_members_without_own_data_or_memory_are_refused_and_not_asked_again(tmp_path):
    """A member whose own data could not be used (too small, malformed) failed every round, its error (the data's
    path, its field names) sent to the PS: it refuses the job once now, with a reason that names neither."""
    data, wrong = tmp_path / "site.txt", tmp_path / "secret-notes.jsonl"
    data.write_text(TEXT)
    wrong.write_text('{"body": "private field"}\n' * 50)
    job = JobConfig(job_id="own", preset="tiny", steps=3, method="fedavg", local_steps=1, own_data=True,
                    round_timeout_s=60)
    workers = {"site": {"CLEAVE_WORKER_DATA": str(data)}, "nodata": {},
               "small": {"CLEAVE_WORKER_DATA": str(data), "CLEAVE_WORKER_ROUND_MEMORY_BYTES": "1000"},
               "unusable": {"CLEAVE_WORKER_DATA": str(wrong)}}
    lines = run(tmp_path / "run", job, workers)
    assert [m["workers"] for m in lines] == [1, 1, 1]
    logs = tmp_path / "run" / "logs"
    ps = (logs / "ps.log").read_text()
    assert ps.count("round_member_refused") == 3
    assert "declared none (cleave worker --data SOURCE)" in ps and "CLEAVE_WORKER_ROUND_MEMORY_BYTES" in ps
    assert "this worker's own data cannot be used for job 'own'" in ps
    for name in ("nodata", "small", "unusable"):  # refused once, then not dealt the job again
        assert (logs / f"{name}.log").read_text().count("round_refused") == 1
    assert "no text field 'text' (it has: body)" in (logs / "unusable.log").read_text()  # its own log says why
    site = (logs / "site.log").read_text()
    assert "data_declared" in site
    for secret in (str(data), "site's own notes", "secret-notes", "body", "private field"):
        assert secret not in ps, secret  # the PS never learns a path, a field or the text


def test_a_job_whose_rounds_accept_nothing_fails_with_what_it_saw(tmp_path):
    job = JobConfig(job_id="empty", preset="tiny", steps=3, method="fedavg", local_steps=1, own_data=True,
                    max_empty_rounds=2, round_timeout_s=60)
    with pytest.raises(PsEnded, match="exited with 4") as ended:
        run(tmp_path / "run", job, {"nodata": {}}, timeout_s=120)
    assert ended.value.exit_code == EXIT_JOB_FAILED  # what `cleave train` ends with: the job's verdict, not 2
    assert "exited with 4: 2 rounds in a row" in str(ended.value)  # the reason, not the bus's last log line
    ps = (tmp_path / "run" / "logs" / "ps.log").read_text()
    assert "2 rounds in a row (round 0) ended with no accepted update" in ps
    assert "declared none" in ps
    assert not (tmp_path / "run" / "m.jsonl").exists() or not (tmp_path / "run" / "m.jsonl").read_text().strip()


@pytest.mark.slow  # ~30 s: a worker dies and is restarted
def test_a_round_that_accepted_nothing_runs_again_without_moving_the_schedule(tmp_path):
    """The only worker dies as round 0 reaches it: the round accepts nothing, is not a step, and runs again
    under the same number once the worker is back; the run is plain training's (same batches, same lr)."""
    job = JobConfig(job_id="redo", preset="tiny", steps=3, method="fedavg", local_steps=1, round_timeout_s=60)
    fleet = LocalFleet(tmp_path / "run", 0)
    try:
        fleet.start()
        fleet.stack.service("solo", "worker", ["--worker-id", "solo"], restart=True,
                            env={"CLEAVE_WORKER_FAIL_AT": "round:0", "CLEAVE_WORKER_FAULT_DIR": str(tmp_path / "f")})
        fleet.start_ps(job, tmp_path / "m.jsonl")
        lines = fleet.wait_ps(tmp_path / "m.jsonl", timeout_s=240)
    finally:
        fleet.stop()
    assert [m["step"] for m in lines] == [0, 1, 2]
    trainer = Trainer(JobConfig(preset="tiny", steps=3))  # one client, E = 1: plain training
    assert_same([m["loss"] for m in lines], [trainer.step(s) for s in range(3)])
    assert [m["lr"] for m in lines] == [lr_at(job, s) for s in range(3)]
    log = (tmp_path / "run" / "logs" / "ps.log").read_text()
    assert log.count("round_empty") == 1 and "solo" in log
    # the worker lost in the attempt that accepted nothing is round 0's recovery (its line said none), and the
    # round's time counts that attempt too
    (ev,) = lines[0]["recovery"]
    assert ev["worker_id"] == "solo" and ev["step"] == 0 and 0 <= ev["detect_s"] <= ev["detect_s"] + ev["complete_s"]
    assert lines[0]["recoveries"] == 1 and lines[0]["step_time_s"] >= ev["detect_s"] + ev["complete_s"] - 1e-6


@pytest.mark.slow  # ~15 s
def test_a_split_client_that_cannot_start_the_job_is_passed_over(tmp_path):
    """Split learning took the lowest worker id as its client: one without own data refused step 0 and the job
    ended (exit 4), with a worker holding data right there. A client that holds nothing yet is replaced."""
    data = tmp_path / "site.txt"
    data.write_text(TEXT)
    job = JobConfig(job_id="split-own", preset="tiny", steps=2, method="split", own_data=True, round_timeout_s=60)
    lines = run(tmp_path / "run", job, {"aa-nodata": {}, "zz-site": {"CLEAVE_WORKER_DATA": str(data)}})
    assert [m["step"] for m in lines] == [0, 1]
    ps = (tmp_path / "run" / "logs" / "ps.log").read_text()
    assert "split_client_passed_over" in ps and "client=aa-nodata" in ps and "client=zz-site" in ps
