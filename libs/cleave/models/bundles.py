"""Base weights and tokenizers over the bus: the PS publishes the files, a worker fetches them once and keeps them.

A job that starts from a Hugging Face directory (`init_from`) or uses a tokenizer from files needs them on every
worker, and a worker is not the PS's machine. So the PS publishes them (`publish`): each file once into the
Object Store `cleave-models` under its SHA-256 (`file.<sha256>`, chunked at the bus's payload size), and a
manifest (`cleave.schemas.Bundle`: every file's name, size, SHA-256 and the SHA-256 of each of its
`DEFAULT_CHUNK_BYTES`) under the SHA-256 of the manifest's own bytes: the bundle id the round and split tasks
carry. A file already there (the same base for another job) is not sent again.

A worker (`BundleCache.fetch`) reads the manifest, checks it against the id, streams each file into its cache
directory checking every chunk's hash as it arrives (a bad chunk is refused by name, not written on), and
renames the finished directory into place: `<cache>/<bundle id>/` then holds the files under their own names,
which `load_hf` and `load_tokenizer` read like any local directory. A bundle already in the cache is checked
once per process against its manifest (sizes and SHA-256s) and used without touching the bus. No NATS
permission beyond reading this one Object Store is needed.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import time
from pathlib import Path

import structlog
from nats.js.api import ObjectMeta, ObjectMetaOptions

from cleave import codec
from cleave.bus import DEFAULT_TIMEOUT_S, Bus
from cleave.errors import ConfigError, CorruptBundle, WireError
from cleave.models.hf import model_files
from cleave.models.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from cleave.schemas import MODELS_OBJECTS, Bundle, BundleFile

log = structlog.get_logger("cleave.bundles")
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024  # hashed unit of a file: a corrupted chunk is named
DEFAULT_FETCH_TIMEOUT_S = 3600.0  # one file of a bundle (a multi-GB shard on a slow link)
FILE_PREFIX = "file."
BUNDLE_PREFIX = "bundle."
MANIFEST = ".bundle"  # the manifest, kept in the cached directory beside the files
MAX_MANIFEST_BYTES = 4 * 1024 * 1024


def describe_file(path: Path, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> BundleFile:
    """A file's size, SHA-256 and per-chunk SHA-256s (read once)."""
    whole, chunks, size = hashlib.sha256(), [], 0
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            whole.update(block)
            chunks.append(hashlib.sha256(block).hexdigest())
            size += len(block)
    return BundleFile(name=path.name, size=size, sha256=whole.hexdigest(), chunk_bytes=chunk_bytes,
                      chunk_sha256=tuple(chunks))


def describe(kind: str, files: list[Path], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Bundle:
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ConfigError(f"a {kind} bundle needs distinct file names, got {names}")
    return Bundle(kind=kind, files=tuple(describe_file(f, chunk_bytes) for f in files))


def job_files(init_from: str | None, tokenizer: str) -> dict[str, list[Path]]:
    """What a job's workers need from the PS's disk: {"model": files, "tokenizer": files}, each when used."""
    out: dict[str, list[Path]] = {}
    if init_from:
        out["model"] = model_files(init_from)
    if tokenizer != DEFAULT_TOKENIZER:
        files = list(getattr(load_tokenizer(tokenizer), "files", ()))
        if files:
            out["tokenizer"] = files
    return out


async def _has(store, name: str, size: int) -> bool:  # noqa: ANN001 - a nats-py ObjectStore
    try:
        info = await asyncio.wait_for(store.get_info(name), DEFAULT_TIMEOUT_S)
    except Exception:  # not found (or unreadable: it is written again)
        return False
    return not info.deleted and info.size == size


async def publish(bus: Bus, kind: str, files: list[Path], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> str:
    """Put the files (those not there yet) and their manifest into the models store; the bundle id."""
    store = await bus.object_store(MODELS_OBJECTS)
    bundle = await asyncio.to_thread(describe, kind, files, chunk_bytes)
    t0, sent = time.perf_counter(), 0
    for entry, path in zip(bundle.files, files, strict=True):
        name = FILE_PREFIX + entry.sha256
        if await _has(store, name, entry.size):
            continue
        meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=bus.max_payload))
        with open(path, "rb") as f:  # noqa: ASYNC230 - the store reads it in a thread
            await asyncio.wait_for(store.put(name, f, meta=meta), DEFAULT_FETCH_TIMEOUT_S)
        sent += entry.size
    data = codec.encode(bundle, compress=False)
    bundle_id = hashlib.sha256(data).hexdigest()
    if not await _has(store, BUNDLE_PREFIX + bundle_id, len(data)):
        await asyncio.wait_for(store.put(BUNDLE_PREFIX + bundle_id, data), DEFAULT_TIMEOUT_S)
    log.info("bundle_published", kind=kind, bundle=bundle_id[:16], files=len(files),
             bytes=sum(f.size for f in bundle.files), sent=sent, seconds=round(time.perf_counter() - t0, 3))
    return bundle_id


class _Verified:
    """The file a fetched object streams into; every chunk's hash is checked as soon as it is complete."""

    def __init__(self, path: Path, entry: BundleFile) -> None:
        self.entry, self.f = entry, open(path, "wb")  # noqa: SIM115 - closed in finish()
        self.h, self.whole, self.fill, self.index, self.size = hashlib.sha256(), hashlib.sha256(), 0, 0, 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        if self.size + len(view) > self.entry.size:
            raise CorruptBundle(f"{self.entry.name} is longer than its manifest says ({self.entry.size} bytes)")
        self.f.write(view)
        self.whole.update(view)
        self.size += len(view)
        while len(view):
            take = min(len(view), self.entry.chunk_bytes - self.fill)
            self.h.update(view[:take])
            self.fill, view = self.fill + take, view[take:]
            if self.fill == self.entry.chunk_bytes:
                self._close_chunk()
        return len(data)

    def _close_chunk(self) -> None:
        want = self.entry.chunk_sha256[self.index] if self.index < len(self.entry.chunk_sha256) else None
        if self.h.hexdigest() != want:
            raise CorruptBundle(f"chunk {self.index} of {self.entry.name} does not match its sha256")
        self.index, self.fill, self.h = self.index + 1, 0, hashlib.sha256()

    def finish(self) -> None:
        self.f.close()
        if self.fill:
            self._close_chunk()
        if self.size != self.entry.size or self.whole.hexdigest() != self.entry.sha256:
            raise CorruptBundle(f"{self.entry.name} is {self.size} of {self.entry.size} bytes or its sha256 differs")

    def abort(self) -> None:
        self.f.close()


def _intact(directory: Path, bundle: Bundle) -> bool:
    """The cached files are the manifest's (sizes and SHA-256)."""
    for entry in bundle.files:
        path = directory / entry.name
        if not path.is_file() or path.stat().st_size != entry.size:
            return False
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(DEFAULT_CHUNK_BYTES):
                h.update(block)
        if h.hexdigest() != entry.sha256:
            return False
    return True


def _cached(directory: Path, bundle_id: str) -> Bundle | None:
    try:
        data = (directory / MANIFEST).read_bytes()
    except OSError:
        return None
    if hashlib.sha256(data).hexdigest() != bundle_id:
        return None
    try:
        return codec.decode(data, Bundle, MAX_MANIFEST_BYTES)
    except WireError:
        return None


class BundleCache:
    """A worker's cache of bundles, by id, under `root` (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root.expanduser()
        self.verified: set[str] = set()  # checked in this process
        self.locks: dict[str, asyncio.Lock] = {}
        self.fetched = 0  # bytes fetched over the bus (tests and logs)

    async def fetch(self, bus: Bus, bundle_id: str) -> Path:
        """The local directory of bundle `bundle_id`, fetched and verified if it is not cached intact."""
        if len(bundle_id) != 64 or not all(c in "0123456789abcdef" for c in bundle_id):
            raise CorruptBundle(f"{bundle_id[:80]!r} is not a bundle id")
        directory = self.root / bundle_id
        async with self.locks.setdefault(bundle_id, asyncio.Lock()):
            if bundle_id in self.verified:
                return directory
            bundle = _cached(directory, bundle_id)
            if bundle is not None and await asyncio.to_thread(_intact, directory, bundle):
                log.info("bundle_cached", bundle=bundle_id[:16], kind=bundle.kind)
            else:
                await self._download(bus, bundle_id, directory)
            self.verified.add(bundle_id)
            return directory

    async def _download(self, bus: Bus, bundle_id: str, directory: Path) -> None:
        t0 = time.perf_counter()
        store = await asyncio.wait_for(bus.js.object_store(MODELS_OBJECTS), DEFAULT_TIMEOUT_S)
        got = await asyncio.wait_for(store.get(BUNDLE_PREFIX + bundle_id), DEFAULT_TIMEOUT_S)
        if hashlib.sha256(got.data).hexdigest() != bundle_id:
            raise CorruptBundle(f"the manifest of bundle {bundle_id[:16]} does not match its id")
        try:
            bundle = codec.decode(got.data, Bundle, MAX_MANIFEST_BYTES)
        except WireError as e:
            raise CorruptBundle(f"the manifest of bundle {bundle_id[:16]} is unreadable: {e}") from None
        part = self.root / f"{bundle_id}.part"
        await asyncio.to_thread(shutil.rmtree, part, True)
        part.mkdir(parents=True)
        for entry in bundle.files:
            out = _Verified(part / entry.name, entry)
            try:
                if entry.size:
                    await asyncio.wait_for(store.get(FILE_PREFIX + entry.sha256, writeinto=out),
                                           DEFAULT_FETCH_TIMEOUT_S)
            except BaseException:
                out.abort()
                raise
            out.finish()
            self.fetched += entry.size
        (part / MANIFEST).write_bytes(got.data)
        await asyncio.to_thread(shutil.rmtree, directory, True)
        part.rename(directory)
        log.info("bundle_fetched", bundle=bundle_id[:16], kind=bundle.kind, files=len(bundle.files),
                 bytes=sum(f.size for f in bundle.files), seconds=round(time.perf_counter() - t0, 3))
