"""Mixed precision on a real fleet: a bf16 or fp16 job equals its own-precision reference while its input
blocks and its results travel in half the bytes of fp32, also when a worker is killed mid-step."""

from __future__ import annotations

import os
import signal

from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from tests.integration.fleet import InProcessPS, start_fleet

STEPS = 3


async def run_steps(ps: InProcessPS, job: JobConfig, steps: int, setup=None) -> tuple[list[float], Trainer]:  # noqa: ANN001
    dist = Trainer(job, ps.backend)
    if setup:
        setup(dist)
    return [await ps.step(lambda s=s: dist.step(s), s) for s in range(steps)], dist


async def test_bf16_equals_its_reference_with_half_the_bytes(tmp_path, nats_url):
    fleet = start_fleet(tmp_path, nats_url, workers=2)
    try:
        sent, back = {}, {}
        for precision in ("fp32", "bf16"):
            job = JobConfig(preset="tiny", batch_size=4, precision=precision)
            ref = Trainer(job)
            want = [ref.step(s) for s in range(STEPS)]
            async with InProcessPS(nats_url) as ps:
                await ps.wait_workers(2)
                got, _ = await run_steps(ps, job, STEPS)
                c = ps.dispatcher.c
                sent[precision] = c.bytes_down / c.tiles
                back[precision] = c.bytes_up / c.tiles
                assert ps.dispatcher.c.rejected == 0
            assert got == want, (precision, got, want)
        assert 0.45 < sent["bf16"] / sent["fp32"] < 0.6  # per tile: the input blocks in 2 bytes, not 4
        assert 0.3 < back["bf16"] / back["fp32"] < 0.6  # ... and the blocks back, rounded by their workers (zstd
        # takes a little more off 2-byte blocks than off 4-byte ones)
    finally:
        fleet.stop()


async def test_fp16_with_loss_scaling_and_a_worker_killed_mid_step(tmp_path, nats_url):
    job = JobConfig(preset="tiny", batch_size=4, precision="fp16")

    def overflow_first(t: Trainer) -> None:
        t.opt.param_groups[0]["loss_scale"] = 2.0**18  # the first steps overflow fp16 and are skipped

    ref = Trainer(job)
    overflow_first(ref)
    want = [ref.step(s) for s in range(4)]
    fleet = start_fleet(tmp_path, nats_url, workers=3)
    try:
        async with InProcessPS(nats_url, tile_timeout_s=0.5, speculate_factor=0) as ps:
            await ps.wait_workers(3)
            dist = Trainer(job, ps.backend)
            overflow_first(dist)
            got = []
            for s in range(4):
                if s == 2:  # freeze a worker while the step's GEMMs are in flight, then kill it
                    os.kill(fleet.stack.procs["worker-2"].popen.pid, signal.SIGSTOP)
                got.append(await ps.step(lambda s=s: dist.step(s), s))
                if s == 2:
                    fleet.stack.kill("worker-2", restart=False)
            assert ps.dispatcher.c.resent > 0
        assert got == want
        assert dist.skipped == ref.skipped >= 1 and dist.scaler.value == ref.scaler.value
    finally:
        fleet.stop()


async def test_bf16_with_a_worker_killed_mid_step(tmp_path, nats_url):
    job = JobConfig(preset="tiny", batch_size=4, precision="bf16")
    ref = Trainer(job)
    want = [ref.step(s) for s in range(STEPS)]
    fleet = start_fleet(tmp_path, nats_url, workers=3)
    try:
        async with InProcessPS(nats_url, tile_timeout_s=0.5, speculate_factor=0) as ps:
            await ps.wait_workers(3)
            dist = Trainer(job, ps.backend)
            got = []
            for s in range(STEPS):
                if s == 1:
                    os.kill(fleet.stack.procs["worker-2"].popen.pid, signal.SIGSTOP)
                got.append(await ps.step(lambda s=s: dist.step(s), s))
                if s == 1:
                    fleet.stack.kill("worker-2", restart=False)
            assert ps.dispatcher.c.resent > 0 and ps.dispatcher.c.recoveries
        assert got == want
    finally:
        fleet.stop()
