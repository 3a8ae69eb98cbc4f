"""The parameter-server service: runs the model and AdamW, deals every linear GEMM to the fleet as tiles."""

from __future__ import annotations

import asyncio

import torch

from cleave import auth
from cleave import bus as busmod
from cleave.errors import ConfigError
from cleave.runtime.lifecycle import run
from cleave.runtime.logs import configure
from cleave.train.job import JobConfig
from cleave_ps.jobs.pretrain import train
from cleave_ps.jobs.rounds import run_rounds
from cleave_ps.jobs.split import run_split
from cleave_ps.settings import PsSettings


async def serve(s: PsSettings, stop: asyncio.Event) -> int:
    job = JobConfig.load(s.job_file) if s.job_file else JobConfig()
    if s.threads:
        torch.set_num_threads(s.threads)
    if s.replicas > 1 and job.method != "cleave":
        raise ConfigError(f"replicas={s.replicas}: several PS replicas train method 'cleave' only, not {job.method!r}")
    name = f"cleave-ps-{job.job_id}" + (f"-r{s.replica}" if s.replicas > 1 else "")  # /connz tells replicas apart
    bus = await busmod.connect(s.nats_url, name, **auth.connect_options(s, "ps"))
    await bus.setup()
    try:
        if job.method in ("diloco", "fedavg"):
            return await run_rounds(s, job, bus, stop)
        if job.method == "split":
            return await run_split(s, job, bus, stop)
        return await train(s, job, bus, stop)
    finally:
        await bus.close()


def main(settings: PsSettings | None = None) -> int:
    settings = settings or PsSettings()
    configure("ps")
    return run(lambda stop: serve(settings, stop))
