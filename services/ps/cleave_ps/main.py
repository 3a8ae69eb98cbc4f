"""The parameter-server service: runs the model and AdamW, deals every linear GEMM to the fleet as tiles."""

from __future__ import annotations

import asyncio
import os

from cleave import auth
from cleave import bus as busmod
from cleave.errors import ConfigError
from cleave.runtime import config_file
from cleave.runtime.lifecycle import run
from cleave.runtime.logs import configure
from cleave.runtime.threads import use_threads
from cleave.train import preflight
from cleave.train.job import JobConfig
from cleave_ps.jobs import lifecycle
from cleave_ps.jobs.pretrain import Pretrain, fit
from cleave_ps.jobs.rounds import Rounds
from cleave_ps.jobs.split import SplitJob
from cleave_ps.settings import PsSettings


async def serve(s: PsSettings, stop: asyncio.Event) -> int:
    config = os.environ.get(config_file.CONFIG_ENV)  # the settings file: its top-level keys are the job's
    job = JobConfig.load(s.job_file or config) if s.job_file or config else JobConfig()
    if s.threads:
        use_threads(s.threads)
    if s.replicas > 1 and job.method != "cleave":
        raise ConfigError(f"replicas={s.replicas}: several PS replicas train method 'cleave' only, not {job.method!r}")
    if job.method == "cleave":  # a job that cannot fit this PS is refused before NATS is dialled
        preflight.check(*await asyncio.to_thread(fit, s, job), [])
    name = f"cleave-ps-{job.job_id}" + (f"-r{s.replica}" if s.replicas > 1 else "")  # /connz tells replicas apart
    bus = await busmod.connect(s.nats_url, name, stop=stop, **auth.connect_options(s, "ps"))
    if bus is None:  # stopped before NATS answered
        return 0
    await bus.setup()
    try:
        return await lifecycle.run(driver(s, job, bus, stop), bus, stop)
    finally:
        await bus.close()


def driver(s: PsSettings, job: JobConfig, bus: busmod.Bus, stop: asyncio.Event) -> lifecycle.Driver:
    """The job's method as a driver of the one lifecycle."""
    if job.method in ("diloco", "fedavg"):
        return Rounds(s, job, bus, stop)
    if job.method == "split":
        return SplitJob(s, job, bus, stop)
    return Pretrain(s, job, bus)


def main(settings: PsSettings | None = None) -> int:
    settings = settings or PsSettings()
    if settings.metrics_out is not None:  # (one it cannot write is named now, not after the first step)
        settings.metrics_out.parent.mkdir(parents=True, exist_ok=True)
        open(settings.metrics_out, "a").close()
    configure("ps")
    return run(lambda stop: serve(settings, stop))
