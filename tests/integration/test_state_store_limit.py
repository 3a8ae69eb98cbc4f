"""A checkpoint store too small for a job's checkpoints is refused with the numbers and the setting to change,
before a step runs and before a byte is written; a store another job has filled fails a commit with one line
(exit 2, no traceback), nothing of it committed, the job's earlier head still there."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys

import pytest
from torch import nn

from cleave import bus as busmod
from cleave.api.fleet import LocalFleet
from cleave.errors import EXIT_ERROR, CleaveError, ConfigError, PsEnded
from cleave.schemas import STATE_BUCKET, STATE_OBJECTS, StateHead
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from cleave_ps.state.persist import KEEP_CHECKPOINTS, MANIFEST_ALLOWANCE, Persister, snapshot

MIB = 1 << 20


async def limited(url: str, job: str, max_bytes: int) -> tuple[busmod.Bus, Persister]:
    bus = await busmod.connect(url, "test")
    await bus.setup()
    p = Persister(bus, job, "{}")
    p.store_max_bytes = max_bytes  # (CLEAVE_PS_STATE_MAX_BYTES: this PS creates the store)
    await p.open()
    await p.claim_epoch()
    return bus, p


async def stored_bytes(bus: busmod.Bus) -> int:
    return (await bus.js.stream_info(f"OBJ_{STATE_OBJECTS}")).state.bytes


async def test_a_store_too_small_for_the_checkpoints_it_keeps_is_refused_before_a_byte_is_written(nats_url):
    model = nn.Linear(1024, 1024)  # 4 MiB: the store must hold three (two kept, the next beside them)
    bus, p = await limited(nats_url, "small", 8 * MIB)
    try:
        assert p.store_limit == 8 * MIB
        with pytest.raises(ConfigError) as refused:
            await p.commit(snapshot(model, None, "small", 0, p.epoch), ())
        need = (KEEP_CHECKPOINTS + 1) * (snapshot(model, None, "small", 0, 1).nbytes * 101 // 100 + MANIFEST_ALLOWANCE)
        assert f"CLEAVE_PS_STATE_MAX_BYTES to at least {need}" in str(refused.value), refused.value
        assert "holds at most 8.0 MiB" in str(refused.value)
        assert await stored_bytes(bus) == 0
        assert await bus.kv_get(await bus.kv(STATE_BUCKET), "small.head", StateHead) is None
    finally:
        await bus.close()


async def test_a_store_another_job_filled_fails_the_commit_and_keeps_the_head_before_it(nats_url):
    model = nn.Linear(512, 512)  # 1 MiB a checkpoint: 3 x (1 + 1 MiB allowance) fit in 8 MiB
    bus, p = await limited(nats_url, "mine", 8 * MIB)
    try:
        first = await p.commit(snapshot(model, None, "mine", 0, p.epoch), ())
        await p.store.put("other/junk", io.BytesIO(bytes(6 * MIB)))  # another job's object takes the rest
        with pytest.raises(CleaveError, match=r"checkpoint store .* is full: the checkpoint of step 1 \(1\.0 MiB\)"):
            await p.commit(snapshot(model, None, "mine", 1, p.epoch), ())
        head = await bus.kv_get(await bus.kv(STATE_BUCKET), "mine.head", StateHead)
        assert head is not None and head[0].object == first.object and await p.load(nn.Linear(512, 512), None)
    finally:
        await bus.close()


def checkpoint_bytes(job: JobConfig) -> int:
    """The bytes of `job`'s checkpoint: its weights and AdamW's state, as the PS holds them from the start."""
    trainer = Trainer(job)
    trainer.hold_optimizer_state()
    return snapshot(trainer.model, trainer.opt, job.job_id, 0, 1).nbytes


def test_the_ps_refuses_a_store_limit_below_its_checkpoints_at_start_in_one_line(nats_url, tmp_path):
    job = JobConfig(job_id="tiny-store", preset="tiny", steps=2)
    job_file = tmp_path / "job.json"
    job_file.write_text(job.model_dump_json())
    run = subprocess.run([sys.executable, "-m", "cleave_cli", "ps", "--nats", nats_url, "--job", str(job_file)],
                         capture_output=True, text=True, timeout=120, env={**{k: v for k, v in os.environ.items() if not k.startswith("CLEAVE_")}, "CLEAVE_PS_STATE_MAX_BYTES": str(MIB)})
    assert run.returncode == EXIT_ERROR, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("cleave: error: the checkpoint store") and "holds at most 1.0 MiB" in last, run.stderr[-3000:]
    assert f"{checkpoint_bytes(job) * 101 // 100 / MIB:.1f} MiB" in last, last
    assert "Traceback" not in run.stderr and "step_done" not in run.stderr


def test_a_commit_that_finds_the_store_full_ends_the_job_with_one_line(nats_url, tmp_path):
    """The first commit of a running job (after its step 0, dealt to a real worker) meets a store that another
    job filled: the PS exits 2 with the reason, not an ExceptionGroup traceback, and commits nothing."""
    job = JobConfig(job_id="crowded", preset="tiny", steps=3)
    one = checkpoint_bytes(job) * 101 // 100 + MANIFEST_ALLOWANCE
    limit = (KEEP_CHECKPOINTS + 1) * one  # exactly what the job needs: the start's check passes

    async def crowd() -> None:
        bus = await busmod.connect(nats_url, "crowd")
        try:
            store = await bus.object_store(STATE_OBJECTS, limit)
            await store.put("another-job/junk", io.BytesIO(bytes(limit - one // 2)))  # half a checkpoint left
        finally:
            await bus.close()

    asyncio.run(crowd())
    fleet = LocalFleet(tmp_path, 1, nats_url=nats_url)
    fleet.start()
    try:
        fleet.start_ps(job, tmp_path / "metrics.jsonl")
        with pytest.raises(PsEnded) as ended:
            fleet.wait_ps(tmp_path / "metrics.jsonl", timeout_s=240)
        log = (tmp_path / "logs" / "ps.log").read_text()
        assert ended.value.status == EXIT_ERROR, ended.value
        assert log.strip().splitlines()[-1].startswith("cleave: error: the checkpoint store (JetStream stream "
                                                      f"OBJ_{STATE_OBJECTS}) is full: the checkpoint of step 0"), log[-3000:]
        assert "Traceback" not in log and "ExceptionGroup" not in log, log[-3000:]
        assert not (tmp_path / "metrics.jsonl").read_text().strip()  # no line: nothing was committed
    finally:
        fleet.stop()

