"""Base weights and tokenizers over the bus (`cleave.models.bundles`) against a real nats-server: served by the
PS from its own disk, fetched once by a worker in parts on its own subject and inbox, every chunk verified,
cached by id; a missing PS is a clear error; a worker needs no JetStream for any of it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from cleave import auth
from cleave import bus as busmod
from cleave.errors import BundleUnavailable, CorruptBundle
from cleave.models import bundles
from cleave.schemas import SUBJECT_MODELS_GET, ModelsGet, ModelsPart
from tests.integration.test_auth import OP_TIMEOUT_S, connect, launch  # noqa: F401 - connect is a fixture

CHUNK = 256 * 1024  # several chunks per file in the test


def files(tmp_path: Path) -> list[Path]:
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "gpt2"}')
    (d / "model.safetensors").write_bytes(os.urandom(3 * CHUNK + 1000))
    (d / "empty.txt").write_bytes(b"")
    return [d / "config.json", d / "model.safetensors", d / "empty.txt"]


async def as_worker(url: str, worker_id: str) -> busmod.Bus:
    """A worker's connection without credentials: its replies under its own inbox, as `connect_options` sets."""
    return await busmod.connect(url, f"worker-{worker_id}", inbox_prefix=auth.inbox_prefix("worker", worker_id))


async def test_served_by_the_ps_fetched_once_and_verified(nats_url, tmp_path):
    ps = await busmod.connect(nats_url, "ps", inbox_prefix=auth.inbox_prefix("ps"))
    worker = await as_worker(nats_url, "w1")
    try:
        paths, shelf = files(tmp_path), bundles.Shelf()
        bid = await shelf.publish(ps, "model", paths, CHUNK)
        assert await shelf.publish(ps, "model", paths, CHUNK) == bid  # the same files: the same id
        cache = bundles.BundleCache(tmp_path / "cache", "w1")
        got = await cache.fetch(worker, bid)
        for p in paths:
            assert (got / p.name).read_bytes() == p.read_bytes()
        assert cache.fetched == sum(p.stat().st_size for p in paths)
        sent = shelf.sent
        again = bundles.BundleCache(tmp_path / "cache", "w1")  # a restarted worker: checked on disk, not fetched
        assert await again.fetch(worker, bid) == got and again.fetched == 0 and shelf.sent == sent
        (got / "model.safetensors").write_bytes(b"tampered")  # a damaged cache is fetched again
        third = bundles.BundleCache(tmp_path / "cache", "w1")
        await third.fetch(worker, bid)
        assert third.fetched > 0 and (got / "model.safetensors").read_bytes() == paths[1].read_bytes()
        # a range past a file's end is answered with an error, not silence
        ask = ModelsGet(kind="file", sha256=bundles.describe_file(paths[1]).sha256, offset=10 * CHUNK, length=10)
        part = await worker.request(SUBJECT_MODELS_GET.format(worker_id="w1"), ask, ModelsPart)
        assert "past the end" in part.error and not part.data
        # the PS's file changed under it: the first bad chunk is refused by name, nothing lands in the cache
        paths[1].write_bytes(os.urandom(paths[1].stat().st_size))
        with pytest.raises(CorruptBundle, match="chunk 0 of model.safetensors"):
            await bundles.BundleCache(tmp_path / "other", "w1").fetch(worker, bid)
        assert not (tmp_path / "other" / bid).exists()
        with pytest.raises(CorruptBundle, match="not a bundle id"):
            await cache.fetch(worker, "../../etc")
        # a bundle no PS holds: every PS stays silent, the worker says so after its tries
        quick = bundles.BundleCache(tmp_path / "quick", "w1", timeout_s=0.3, tries=2)
        with pytest.raises(BundleUnavailable, match=f"bundle {'ab' * 8}: no PS answered for its manifest"):
            await quick.fetch(worker, "ab" * 32)
    finally:
        await ps.close()
    try:  # no PS at all: the server tells the worker that nobody listens, the error names the bundle
        with pytest.raises(BundleUnavailable, match=f"bundle {bid[:16]}: no PS answered.*PS running"):
            await bundles.BundleCache(tmp_path / "gone", "w1", tries=2).fetch(worker, bid)
    finally:
        await worker.close()


async def test_a_worker_fetches_with_its_own_credential_and_no_jetstream(tmp_path, connect):  # noqa: F811
    """Per-worker credentials, a small max_payload (so every file travels in several parts, a window of them
    in flight): the worker fetches the bundle on `cleave.models.w1` and its inbox, with no permission violation;
    it may use no JetStream API (the old models store's included) and may not ask as another worker."""
    for server in launch(tmp_path, worker_ids="w1,w2", max_payload=64 * 1024):
        ps_c = await connect(server.settings("ps"), "ps")
        w_c = await connect(server.settings("worker", "worker-w1"), "worker")
        ps, worker = busmod.Bus(ps_c.nc, "ps"), busmod.Bus(w_c.nc, "worker")
        assert worker.max_payload < CHUNK // 4  # the weights file travels in 14 parts, 4 at a time
        paths, shelf = files(tmp_path), bundles.Shelf()
        async with asyncio.timeout(6 * OP_TIMEOUT_S):
            await ps.setup()
            bid = await shelf.publish(ps, "model", paths, CHUNK)
            try:
                got = await bundles.BundleCache(tmp_path / "cache", "w1").fetch(worker, bid)
            except BundleUnavailable:
                raise AssertionError(w_c.errors, ps_c.errors) from None
        assert [(got / p.name).read_bytes() for p in paths] == [p.read_bytes() for p in paths]
        assert shelf.sent == sum(p.stat().st_size for p in paths) + len((got / bundles.MANIFEST).read_bytes())
        assert w_c.errors == [] and ps_c.errors == [] and ps.rejected == {}
        for subject in ("$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.INFO.OBJ_cleave-models",
                        "$JS.API.CONSUMER.CREATE.OBJ_cleave-models", "$JS.API.DIRECT.GET.OBJ_cleave-models",
                        "$O.cleave-models.C.forged", SUBJECT_MODELS_GET.format(worker_id="w2")):
            await w_c.nc.publish(subject, b"{}", reply="_INBOX.worker.w1.x.1")
            assert "publish" in await w_c.violation(subject)


async def test_workers_sharing_a_cache_fetch_a_bundle_once(nats_url, tmp_path):
    """A machine's workers share one model cache: each staged into the same folder and removed the other's, so
    one worker's first round failed (FileExistsError, FileNotFoundError) on every first fine-tune."""
    ps = await busmod.connect(nats_url, "ps", inbox_prefix=auth.inbox_prefix("ps"))
    workers = [await as_worker(nats_url, f"w{i}") for i in range(3)]
    try:
        paths = files(tmp_path)
        bid = await bundles.Shelf().publish(ps, "model", paths, CHUNK)
        caches = [bundles.BundleCache(tmp_path / "cache", f"w{i}") for i in range(3)]  # as separate processes
        got = await asyncio.gather(*(c.fetch(w, bid) for c, w in zip(caches, workers, strict=True)))
        assert len(set(got)) == 1 and all((got[0] / p.name).read_bytes() == p.read_bytes() for p in paths)
        assert sorted(c.fetched for c in caches) == [0, 0, sum(p.stat().st_size for p in paths)]
    finally:
        for bus in (ps, *workers):
            await bus.close()


async def test_a_worker_asking_again_and_again_is_told_to_wait_and_the_others_are_not(nats_url, tmp_path):
    """Each worker id draws at most its budget of the PS's bytes (here: everything served once, refilled in 2
    s): past it a request is told when to ask again, with no bytes and nothing read from the disk; a fetch
    past it waits as told and finishes; another worker's fetch meanwhile is never told to wait."""
    ps = await busmod.connect(nats_url, "ps", inbox_prefix=auth.inbox_prefix("ps"))
    hog, other = await as_worker(nats_url, "w1"), await as_worker(nats_url, "w2")
    try:
        paths, shelf = files(tmp_path), bundles.Shelf(copies=1, min_burst=0, refill_s=2.0)
        bid = await shelf.publish(ps, "model", paths, CHUNK)
        first = bundles.BundleCache(tmp_path / "hog-1", "w1")
        await first.fetch(hog, bid)  # its whole budget
        assert first.deferred == 0 and shelf.deferred == 0
        sent, weights = shelf.sent, bundles.describe_file(paths[1]).sha256
        ask = ModelsGet(kind="file", sha256=weights, length=CHUNK, waits=True)
        subject = SUBJECT_MODELS_GET.format(worker_id="w1")
        answers = await asyncio.gather(*(hog.request(subject, ask, ModelsPart) for _ in range(50)))
        assert all(0 < a.retry_after_s <= 2.0 and not a.data and not a.error for a in answers), answers[0]
        assert shelf.sent == sent and shelf.deferred == 50
        with pytest.raises(TimeoutError):  # one that does not wait (an older worker's) is not answered at all
            await hog.request(subject, ask.model_copy(update={"waits": False}), ModelsPart, timeout_s=0.5)
        again, elsewhere = bundles.BundleCache(tmp_path / "hog-2", "w1"), bundles.BundleCache(tmp_path / "w2", "w2")
        got = await asyncio.gather(again.fetch(hog, bid), elsewhere.fetch(other, bid))
        assert [(got[0] / p.name).read_bytes() for p in paths] == [p.read_bytes() for p in paths]
        assert [(got[1] / p.name).read_bytes() for p in paths] == [p.read_bytes() for p in paths]
        assert again.deferred > 0 and elsewhere.deferred == 0, (again.deferred, elsewhere.deferred)
    finally:
        for bus in (ps, hog, other):
            await bus.close()
