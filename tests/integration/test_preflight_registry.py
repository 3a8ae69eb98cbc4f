"""The preflight reads the workers' declared memory budgets from the registry of a running stack, instead of
assuming every worker has the default, and refuses a job whose thinnest tile no registered worker can hold."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from cleave import bus as busmod
from cleave.api.fleet import LocalFleet
from cleave_ps.jobs.pretrain import worker_budgets

KIB256 = 256 * 1024


async def test_the_registry_budgets_reach_the_preflight(tmp_path, nats_url):
    fleet = LocalFleet(tmp_path, 0, nats_url=nats_url)
    fleet.start()
    for memory in (KIB256, 2 * KIB256):  # gpt2-medium's thinnest tile (16 x 16 of K = 8,192) needs 1.05 MB
        fleet.add_worker(env={"CLEAVE_WORKER_MEMORY_BYTES": str(memory)})
    try:
        fleet.wait_joined()
        bus = await busmod.connect(nats_url, "test-budgets")
        try:  # the scheduler logs a join before its outbox writes the registry entry: read until both are there
            for _ in range(300):  # (30 s)
                if len(budgets := await worker_budgets(bus)) == 2:
                    break
                await asyncio.sleep(0.1)
            assert sorted(budgets) == [KIB256, 2 * KIB256]
        finally:
            await bus.close()

        def dry(preset: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "cleave_cli", "train", "--preset", preset, "--nats", nats_url,
                                   "--dry-run"], capture_output=True, text=True, timeout=120)

        ok = dry("tiny")
        assert ok.returncode == 0 and "workers      2, memory_bytes 0.25-0.50 MiB" in ok.stdout, ok.stdout + ok.stderr
        refused = dry("gpt2-medium")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "over every worker's memory_bytes (at most 0.50 MiB)" in refused.stderr, refused.stderr
    finally:
        fleet.stop()
