"""The PS's activation memory on a real fleet: recomputed blocks, micro-batches and the head in chunks of
tokens train exactly as their same-option reference, also with a worker killed mid-step; and the PS's
preflight turns recomputation on when, and only when, the job would not fit its memory without it; outputs
in memory the PS reuses change nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from cleave.train import preflight
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from cleave_ps.fleet.products import Products
from tests.integration.fleet import InProcessPS, start_fleet

# tiny's 256-token vocabulary: 8 x 64 tokens in 2 micro-batches of 256, each head in 4 chunks of 64 tokens
OPTIONS = dict(preset="tiny", batch_size=8, recompute=True, micro_batches=2, logits_bytes=64 * 256 * 4)


async def test_recompute_micro_batches_and_a_chunked_head_equal_their_reference(tmp_path, nats_url):
    job = JobConfig(steps=3, **OPTIONS)
    ref = Trainer(job)
    want = [ref.step(s) for s in range(job.steps)]
    fleet = start_fleet(tmp_path, nats_url, workers=3)
    try:
        async with InProcessPS(nats_url, tile_timeout_s=0.5, speculate_factor=0) as ps:
            await ps.wait_workers(3)
            dist = Trainer(job, ps.backend)
            assert dist.layout.recompute and dist.layout.micro_batches == 2 and dist.layout.head_chunks == 4
            got = []
            for s in range(job.steps):
                if s == 1:  # a worker frozen, then killed, while the step's GEMMs (recomputed ones too) are out
                    victim = fleet.stack.procs["worker-2"].popen
                    os.kill(victim.pid, signal.SIGSTOP)
                    got.append(await ps.step(lambda s=s: dist.step(s), s))
                    fleet.stack.kill("worker-2", restart=False)
                else:
                    got.append(await ps.step(lambda s=s: dist.step(s), s))
            assert got == want
            assert ps.dispatcher.c.resent > 0 and ps.dispatcher.c.concurrent >= 2
    finally:
        fleet.stop()


async def test_outputs_in_reused_memory_train_bit_for_bit_as_the_reference(tmp_path, nats_url):
    """Every GEMM output taken from the PS's pool (`cleave_ps.fleet.products`, here for outputs of any size):
    recomputed blocks, micro-batches and autograd's saved outputs never see a buffer handed out twice."""
    job = JobConfig(steps=3, **OPTIONS)
    ref = Trainer(job)
    want = [ref.step(s) for s in range(job.steps)]
    fleet = start_fleet(tmp_path, nats_url, workers=2)
    try:
        async with InProcessPS(nats_url) as ps:
            pool = ps.dispatcher.products = Products(cap=64 << 20, smallest=0)
            await ps.wait_workers(2)
            dist = Trainer(job, ps.backend)
            assert [await ps.step(lambda s=s: dist.step(s), s) for s in range(job.steps)] == want
            assert pool.reused > pool.fresh > 0
    finally:
        fleet.stop()


@pytest.mark.slow
def test_the_ps_recomputes_when_the_batch_would_not_fit_and_equals_the_reference(tmp_path):
    job = JobConfig(job_id="fits", steps=3, **{**OPTIONS, "recompute": None})
    plain = preflight.estimate(job.model_copy(update={"recompute": False}), workers=2)
    again = preflight.estimate(job.model_copy(update={"recompute": True}), workers=2)
    budget = (plain.total + again.total) // 2  # fits only with recompute
    (tmp_path / "job.json").write_text(job.model_dump_json())
    common = [sys.executable, "-m", "cleave_cli", "train", "--config", str(tmp_path / "job.json")]
    env = {**os.environ, "CLEAVE_PS_MEMORY_BYTES": str(budget)}
    dry = subprocess.run([*common, "--dry-run"], capture_output=True, text=True, timeout=120, env=env)
    assert dry.returncode == 0 and "recompute on" in dry.stdout and "fits" in dry.stdout, dry.stdout + dry.stderr
    dist, ref = tmp_path / "dist.jsonl", tmp_path / "ref.jsonl"
    out = subprocess.run([*common, "--workers", "2", "--metrics-out", str(dist), "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    subprocess.run([*common, "--reference", "--metrics-out", str(ref), "--run-dir", str(tmp_path / "ref")],
                   check=True, capture_output=True, timeout=120, env=env)
    lines = [json.loads(line) for line in dist.read_text().splitlines()]
    assert [m["loss"] for m in lines] == [json.loads(line)["loss"] for line in ref.read_text().splitlines()]
    assert all(m["peak_rss_bytes"] > 0 for m in lines)
    log = (tmp_path / "run" / "logs" / "ps.log").read_text()
    assert "recompute=True" in log and "head_chunks=4" in log and "micro_batches=2" in log, log[-2000:]
    assert "free_outputs_gb=0.0" in log, log[-2000:]  # a tiny job's outputs stay under the pool's 1 MiB
    assert json.loads((tmp_path / "run" / "job.json").read_text())["recompute"] is True  # decided before the PS


@pytest.mark.slow
def test_the_ps_defers_fewer_weight_gradients_when_all_of_them_would_not_fit(tmp_path):
    job = JobConfig(job_id="defers", steps=2, **OPTIONS)
    eight = preflight.estimate(job, workers=2, deferred=8)
    assert eight.deferring(1).total < eight.deferring(2).total < eight.total
    (tmp_path / "job.json").write_text(job.model_dump_json())
    common = [sys.executable, "-m", "cleave_cli", "train", "--config", str(tmp_path / "job.json")]
    env = {**os.environ, "CLEAVE_PS_MEMORY_BYTES": str(eight.deferring(2).total), "CLEAVE_PS_DEFERRED_GEMMS": "8"}
    dist, ref = tmp_path / "dist.jsonl", tmp_path / "ref.jsonl"
    out = subprocess.run([*common, "--workers", "2", "--metrics-out", str(dist), "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    log = (tmp_path / "run" / "logs" / "ps.log").read_text()
    assert "deferred_gemms_lowered" in log and "deferred_gemms=2" in log, log[-2000:]
    subprocess.run([*common, "--reference", "--metrics-out", str(ref), "--run-dir", str(tmp_path / "ref")],
                   check=True, capture_output=True, timeout=120, env=env)
    assert [json.loads(x)["loss"] for x in dist.read_text().splitlines()] == \
        [json.loads(x)["loss"] for x in ref.read_text().splitlines()]
