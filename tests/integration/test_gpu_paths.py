"""A CUDA PS's path, run here on the CPU: the PS's GEMM inputs staged through host copies (one per input and
GEMM, the previous GEMM's reused), with the blocks named by the tensors the model holds, so that the workers'
caches hit exactly as when the PS ships its own tensors. Real nats-server, real worker processes, compared
with plain PyTorch; on a GPU machine `benchmarks/gpu.py` runs the same with the model on CUDA."""

from __future__ import annotations

from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from tests.integration.fleet import InProcessPS, assert_same, start_fleet


async def test_staged_inputs_train_exactly_and_keep_the_workers_caches(tmp_path, nats_url):
    job = JobConfig(preset="tiny-llama", steps=2, batch_size=2)  # q, k and v share their input X
    ref = Trainer(job)
    want = [ref.step(s) for s in range(job.steps)]
    fleet = start_fleet(tmp_path, nats_url, workers=1)  # one worker: the same tiles, in the same order
    try:
        runs = {}
        for stage in (False, True):
            async with InProcessPS(nats_url, tile_timeout_s=60, speculate_factor=0) as ps:
                await ps.wait_workers(1)
                ps.backend.stage = stage
                dist = Trainer(job, ps.backend)
                got = [await ps.step(lambda s=s, dist=dist: dist.step(s), s) for s in range(job.steps)]
                runs[stage] = (got, ps.dispatcher.c, ps.backend.staging)
        for stage, (got, c, _) in runs.items():
            assert_same(got, want, rtol=0)
            assert c.rejected == 0 and c.cache_misses == 0, stage
        staging = runs[True][2]
        assert staging.copies > 0 and staging.reused > 0  # k and v reuse q's copy of X
        assert runs[False][2].copies == 0
        # the blocks keep their names through the copies: the worker's cache hits as often, nothing more is sent
        assert runs[True][1].bytes_down == runs[False][1].bytes_down
        assert runs[True][1].tiles == runs[False][1].tiles
    finally:
        fleet.stop()

