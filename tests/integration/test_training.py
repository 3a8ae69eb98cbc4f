"""End to end on a real nats-server with real worker processes: the fleet trains the reference's model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import torch

from cleave import bus as busmod
from cleave import codec
from cleave.api.state import state_server
from cleave.schemas import EVENTS_STREAM, Event, events_subject
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from tests.integration.fleet import InProcessPS, assert_same, grads, start_fleet


def read_losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_cli_train_matches_reference(tmp_path):
    common = [sys.executable, "-m", "cleave_cli", "train", "--preset", "tiny", "--steps", "20", "--seed", "0"]
    dist, ref = tmp_path / "a.jsonl", tmp_path / "ref.jsonl"
    out = subprocess.run([*common, "--workers", "3", "--metrics-out", str(dist), "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    subprocess.run([*common, "--reference", "--metrics-out", str(ref), "--run-dir", str(tmp_path / "ref")],
                   check=True, capture_output=True, timeout=120)
    got, want = read_losses(dist), read_losses(ref)
    assert_same(got, want)
    assert got[-1] < got[0] - 0.5  # it learns
    lines = [json.loads(line) for line in dist.read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(20))
    assert all(m["workers"] == 3 and m["tiles"] > 0 and m["bytes_down"] > 0 and m["bytes_up"] > 0 for m in lines)
    assert all(0 < m["verify_cpu_s"] < m["step_time_s"] for m in lines)  # every block checked, on the PS's CPU
    stack = json.loads((tmp_path / "run" / "stack.json").read_text())
    assert {p["role"] for p in stack["processes"]} >= {"nats", "scheduler", "worker", "ps"}
    ps_log = (tmp_path / "run" / "logs" / "ps.log").read_text()
    assert "job_done" in ps_log and "nats_disconnected" not in ps_log, ps_log[-3000:]  # its own close is no loss
    done = asyncio.run(last_event(tmp_path / "run", "job_done"))
    job_id = json.loads((tmp_path / "run" / "job.json").read_text())["job_id"]
    assert done.job == job_id and done.step == 19 and done.detail["steps"] == 20


async def last_event(run_dir, kind: str) -> Event:
    """The newest `kind` event in the run's JetStream store (the stack is down: a server on its store)."""
    with state_server(run_dir) as url:
        bus = await busmod.connect(url, "test-events")
        try:
            msg = await bus.js.get_last_msg(EVENTS_STREAM, events_subject(kind))
            return codec.decode(msg.data, Event)
        finally:
            await bus.close()


async def test_gradients_match_plain_pytorch(tmp_path, nats_url):
    job = JobConfig(preset="tiny-llama", batch_size=4)
    fleet = start_fleet(tmp_path, nats_url, workers=2)
    try:
        async with InProcessPS(nats_url) as ps:
            await ps.wait_workers(2)
            ref, dist = Trainer(job), Trainer(job, ps.backend)
            x, y = ref.corpus.batch(0, 0, 4, job.seq)

            def backward(trainer):
                trainer.model.zero_grad()
                loss = trainer.loss(x, y)
                loss.backward()
                return loss.item()

            want = backward(ref)
            got = await ps.step(lambda: backward(dist), 0)
            assert abs(got - want) <= 1e-5 * abs(want)
            g_ref, g_dist = grads(ref.model), grads(dist.model)
            for name in g_ref:
                torch.testing.assert_close(g_dist[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)
            # the Q, K and V products share their input rows: workers cached them instead of receiving them again
            assert ps.dispatcher.c.tiles > 0 and ps.dispatcher.c.rejected == 0
            assert ps.dispatcher.c.concurrent >= 2  # deferred, yet in place when backward returned
    finally:
        fleet.stop()


async def test_worker_killed_mid_step_costs_only_its_tiles(tmp_path, nats_url):
    job = JobConfig(preset="tiny", steps=6)
    fleet = start_fleet(tmp_path, nats_url, workers=3)
    try:
        async with InProcessPS(nats_url, tile_timeout_s=0.5, speculate_factor=0) as ps:
            await ps.wait_workers(3)
            ref, dist = Trainer(job), Trainer(job, ps.backend)
            want = [ref.step(s) for s in range(job.steps)]
            got = []
            for s in range(job.steps):
                if s == 3:  # freeze, then kill, a worker while the step's GEMMs are in flight
                    victim = fleet.stack.procs["worker-2"].popen
                    os.kill(victim.pid, signal.SIGSTOP)
                    step = ps.step(lambda s=s: dist.step(s), s)
                    got.append(await step)
                    fleet.stack.kill("worker-2", restart=False)
                else:
                    got.append(await ps.step(lambda s=s: dist.step(s), s))
            assert_same(got, want)
            assert ps.dispatcher.c.concurrent >= 2  # weight gradients were dealt beside the input gradients
            assert ps.dispatcher.c.resent > 0
            assert ps.dispatcher.c.recoveries and ps.dispatcher.c.recoveries[0].worker_id.endswith("w2")
    finally:
        fleet.stop()


async def test_half_precision_tiles_are_an_approximate_mode(tmp_path, nats_url):
    """bf16 input blocks halve the downlink; the loss stays close to the exact path, but is not equal."""
    job = JobConfig(preset="tiny", steps=4)
    fleet = start_fleet(tmp_path, nats_url, workers=2)
    try:
        want = [Trainer(job).step(s) for s in range(1)]
        sizes = {}
        for mode in ("fp32", "bf16"):
            async with InProcessPS(nats_url, tile_dtype=mode) as ps:
                await ps.wait_workers(2)
                dist = Trainer(job, ps.backend)
                got = [await ps.step(lambda dist=dist: dist.step(0), 0)]
                sizes[mode] = ps.dispatcher.c.bytes_down
        assert abs(got[0] - want[0]) <= 1e-2 * abs(want[0]) and got[0] != want[0]
        assert sizes["bf16"] < 0.6 * sizes["fp32"]
    finally:
        fleet.stop()
