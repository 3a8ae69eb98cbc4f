"""Base weights and tokenizers over the bus (`cleave.models.bundles`) against a real nats-server: published once
by the PS, fetched once by a worker, every chunk verified, cached by id; a worker credential may read the
models store and write nothing to it."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from cleave import bus as busmod
from cleave.errors import CorruptBundle
from cleave.models import bundles
from cleave.schemas import MODELS_OBJECTS
from tests.integration.test_auth import OP_TIMEOUT_S, connect, launch  # noqa: F401 - connect is a fixture

CHUNK = 256 * 1024  # several chunks per file in the test


def files(tmp_path: Path) -> list[Path]:
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "gpt2"}')
    (d / "model.safetensors").write_bytes(os.urandom(3 * CHUNK + 1000))
    return [d / "config.json", d / "model.safetensors"]


async def test_published_once_fetched_once_and_verified(nats_url, tmp_path):
    ps = await busmod.connect(nats_url, "ps")
    worker = await busmod.connect(nats_url, "worker")
    try:
        paths = files(tmp_path)
        bid = await bundles.publish(ps, "model", paths, CHUNK)
        assert await bundles.publish(ps, "model", paths, CHUNK) == bid  # the same files: the same id, nothing sent
        cache = bundles.BundleCache(tmp_path / "cache")
        got = await cache.fetch(worker, bid)
        for p in paths:
            assert (got / p.name).read_bytes() == p.read_bytes()
        assert cache.fetched == sum(p.stat().st_size for p in paths)
        again = bundles.BundleCache(tmp_path / "cache")  # a restarted worker: checked on disk, not fetched
        assert await again.fetch(worker, bid) == got and again.fetched == 0
        (got / "model.safetensors").write_bytes(b"tampered")  # a damaged cache is fetched again
        third = bundles.BundleCache(tmp_path / "cache")
        await third.fetch(worker, bid)
        assert third.fetched > 0 and (got / "model.safetensors").read_bytes() == paths[1].read_bytes()
        # a store whose file object was replaced: the first bad chunk is refused, nothing lands in the cache
        store = await ps.object_store(MODELS_OBJECTS)
        digest = hashlib.sha256(paths[1].read_bytes()).hexdigest()
        await store.put(bundles.FILE_PREFIX + digest, os.urandom(paths[1].stat().st_size))
        with pytest.raises(CorruptBundle, match="chunk 0 of model.safetensors"):
            await bundles.BundleCache(tmp_path / "other").fetch(worker, bid)
        assert not (tmp_path / "other" / bid).exists()
        with pytest.raises(CorruptBundle, match="not a bundle id"):
            await cache.fetch(worker, "../../etc")
    finally:
        await ps.close()
        await worker.close()


async def test_a_worker_credential_reads_the_models_store_and_writes_nothing(tmp_path, connect):  # noqa: F811
    for server in launch(tmp_path, worker_ids="w1"):
        ps_c = await connect(server.settings("ps"), "ps")
        w_c = await connect(server.settings("worker", "worker-w1"), "worker")
        ps, worker = busmod.Bus(ps_c.nc, "ps"), busmod.Bus(w_c.nc, "worker")
        async with asyncio.timeout(6 * OP_TIMEOUT_S):
            await ps.setup()
            bid = await bundles.publish(ps, "model", files(tmp_path), CHUNK)
            try:
                got = await bundles.BundleCache(tmp_path / "cache").fetch(worker, bid)
            except TimeoutError:
                raise AssertionError(w_c.errors) from None
        assert (got / "config.json").is_file() and w_c.errors == [] and ps_c.errors == []
        for subject in (f"$O.{MODELS_OBJECTS}.C.forged", f"$JS.API.STREAM.PURGE.OBJ_{MODELS_OBJECTS}",
                        f"$JS.API.CONSUMER.DELETE.OBJ_{MODELS_OBJECTS}.x"):
            await w_c.nc.publish(subject, b"forged")
            assert "publish" in await w_c.violation(subject)
