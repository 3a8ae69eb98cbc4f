"""Test helpers: a scheduler and worker processes on a test nats-server, and an in-process PS dispatcher."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import torch

from cleave import bus as busmod
from cleave.api.fleet import LocalFleet
from cleave.schemas import SUBJECT_RESULTS, TileResult
from cleave_ps.fleet.bridge import FleetGemm
from cleave_ps.fleet.dispatcher import Dispatcher
from cleave_ps.fleet.plans import PlanWatch
from cleave_ps.settings import PsSettings

READY_TIMEOUT_S = 30.0


def start_fleet(run_dir: Path, nats_url: str, workers: int, **worker_env: str) -> LocalFleet:
    fleet = LocalFleet(run_dir, workers, nats_url=nats_url, worker_env=worker_env)
    fleet.start()
    return fleet


class InProcessPS:
    """The PS's dispatcher and GEMM backend in the test process, so tests can look inside."""

    def __init__(self, nats_url: str, job_id: str = "test", connect: dict | None = None, **settings: object) -> None:
        """`connect`: options of the PS's connection (its credential: `cleave.auth.connect_options`)."""
        self.nats_url, self.job_id, self.connect = nats_url, job_id, connect or {}
        self.settings = PsSettings(nats_url=nats_url, **settings)
        self.stop = asyncio.Event()

    async def __aenter__(self) -> InProcessPS:
        self.bus = await busmod.connect(self.nats_url, "test-ps", **self.connect)
        await self.bus.setup()
        self.epoch = time.time_ns()
        self.dispatcher = Dispatcher(self.bus, self.job_id, self.epoch, self.settings)
        self.backend = FleetGemm(asyncio.get_running_loop(), self.dispatcher)
        self.sub = await self.bus.subscribe(SUBJECT_RESULTS.format(job=self.job_id, epoch=self.epoch, worker_id="*"),
                                            TileResult, self.dispatcher.on_result,
                                            max_bytes=self.settings.max_result_bytes, sender="worker_id",
                                            compressed=False, cap=self.dispatcher.result_limit)
        self.watcher = asyncio.create_task(PlanWatch(self.bus, on_plan=self.dispatcher.set_plan).follow(self.stop))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        self.dispatcher.stopping = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.watcher, 5)
        await self.sub.unsubscribe()
        await self.bus.close()

    async def wait_workers(self, n: int) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(self.dispatcher.workers) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.dispatcher.workers)} of {n} workers joined")
            await asyncio.sleep(0.05)

    async def step(self, fn, step: int):
        """Run `fn()` (which uses self.backend) in a thread as training step `step`."""
        self.backend.begin(step)
        return await asyncio.to_thread(fn)


def assert_same(got: list[float], want: list[float], rtol: float = 1e-4) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= rtol * abs(w), f"step {i}: {g} vs reference {w}"


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}
