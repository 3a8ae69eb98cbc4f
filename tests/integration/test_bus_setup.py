"""A hub whose nats-server cannot hold Cleave's streams and buckets (JetStream's storage, max_file_store,
below their size limits) is told which one and why, not "bucket not found" in a loop: the compose end-to-end run
once spent its 300 s that way on a disk with 2.8 GB free (nats-server's default storage is 75% of it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cleave import bus as busmod
from cleave.errors import CreateRefused
from cleave.schemas import PLAN_BUCKET, REGISTRY_BUCKET, STATE_BUCKET
from tests.conftest import NatsServer


async def test_a_bucket_the_server_has_no_storage_for_is_named_with_the_servers_reason(tmp_path: Path) -> None:
    config = tmp_path / "nats.conf"
    config.write_text("jetstream { max_file_store: 1GB }\n")  # the events stream and registry fit, the plans not
    server = NatsServer(tmp_path / "js", tmp_path / "nats.log", config)
    server.start()
    try:
        bus = await busmod.connect(server.url, "setup-test")
        try:
            for _ in range(2):  # and again, as a service that retries would
                with pytest.raises(CreateRefused) as refused:
                    await bus.setup()
                why = str(refused.value)
                assert why.startswith(f"NATS refused to create KV bucket {PLAN_BUCKET} (1,024 MiB): insufficient storage")
                assert "max_file_store" in why and len(repr(refused.value)) <= 200  # (the runner logs 200 characters)
            assert (await bus.js.stream_info(f"KV_{REGISTRY_BUCKET}")).config.max_bytes == 64 << 20  # (what fits)
        finally:
            await bus.close()
    finally:
        server.stop()


async def test_setup_twice_at_once_uses_one_set_of_buckets(nats_url: str) -> None:
    buses = [await busmod.connect(nats_url, f"setup-{i}") for i in range(2)]
    try:
        await asyncio.gather(*(b.setup() for b in buses))
        await buses[0].setup()
        names = {s.config.name for s in await buses[0].js.streams_info()}
        assert {f"KV_{b}" for b in (REGISTRY_BUCKET, PLAN_BUCKET, STATE_BUCKET)} <= names
    finally:
        for b in buses:
            await b.close()
