"""Base weights and tokenizers over the bus: the PS serves the files, a worker fetches them once and keeps them.

A job that starts from a Hugging Face directory (`init_from`) or uses a tokenizer from files needs them on every
worker, and a worker is not the PS's machine. So the PS publishes them (`Shelf.publish`): it describes the files
in a manifest (`cleave.schemas.Bundle`: every file's name, size, SHA-256 and the SHA-256 of each of its
`DEFAULT_CHUNK_BYTES`), whose own SHA-256 is the bundle id the round and split tasks carry, and from then on
answers the workers' requests for them (`ModelsGet` on `cleave.models.<worker id>`: the manifest by bundle id,
a byte range of a file by its SHA-256), reading the files from its own disk in a thread, within each worker's
budget of its bytes (below). It answers only on the requesting worker's own inbox (`cleave.auth.reply_refusal`;
any other reply subject is refused and logged, `reply_refused`), and stays silent about what it does not hold:
several PS processes (several jobs on a hub) each answer for their own bundles.

A worker fetches a bundle once and keeps it, so each worker id may draw (`cleave.runtime.budgets`) at most
`DEFAULT_COPIES` times the bytes the PS serves at once (at least `DEFAULT_MIN_BURST_BYTES`), refilled over
`DEFAULT_REFILL_S` (a part larger than the whole budget draws all of it): a worker asking again and again gets
an answer of tens of bytes saying when to ask again (`ModelsPart.retry_after_s`, to a request that `waits`;
silence to one that does not), read nothing from the disk, and the others' requests behind it are answered in
their turn.

A worker (`BundleCache.fetch`) asks for the manifest, checks it against the id, streams each file into its cache
directory (`DEFAULT_WINDOW` requests in flight, each retried `DEFAULT_TRIES` times; then `BundleUnavailable`)
checking every chunk's hash as it arrives (a bad chunk is refused by name, not written on), and renames the
finished directory into place: `<cache>/<bundle id>/` then holds the files under their own names, which
`load_hf` and `load_tokenizer` read like any local directory. A bundle already in the cache is checked once per
process against its manifest (sizes and SHA-256s) and used without touching the bus. Worker processes that share
a cache (a machine's several workers) take a file lock per bundle (`<bundle id>.lock`): one fetches, the others
wait and find it cached. A worker needs no
JetStream for this: it publishes its requests on its own subject and reads the answers in its own inbox.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path

import structlog
from filelock import AsyncFileLock

from cleave import codec
from cleave.auth import reply_refusal, requester
from cleave.bus import TRANSIENT, Bus
from cleave.errors import BundleUnavailable, ConfigError, CorruptBundle, WireError
from cleave.models.hf import model_files
from cleave.models.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from cleave.runtime.budgets import Budgets
from cleave.schemas import (
    MAX_MODELS_PART_BYTES,
    MAX_MODELS_RETRY_S,
    SUBJECT_MODELS_GET,
    SUBJECT_MODELS_GET_ALL,
    Bundle,
    BundleFile,
    ModelsGet,
    ModelsPart,
)

log = structlog.get_logger("cleave.bundles")
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024  # hashed unit of a file: a corrupted chunk is named
DEFAULT_WINDOW = 4  # a worker's requests in flight (one part each, at most max_payload)
DEFAULT_PART_TIMEOUT_S = 60.0  # one request's answer (a window of 1 MB parts on a 1 Mbit/s link: 32 s)
DEFAULT_TRIES = 4  # of one request, 0.5 s, 1 s, 2 s apart, before `BundleUnavailable`
PART_ENVELOPE = 1024  # bytes of an answer that are not the object's (its fields and the codec's header)
MAX_REQUEST_BYTES = 4096  # a request (`ModelsGet`, ~130 bytes) as the PS decodes it
DEFAULT_COPIES = 2  # of everything the PS serves, a worker id may draw at once (a fetch, and one more)
DEFAULT_MIN_BURST_BYTES = 256 * 1024 * 1024  # ... at least (a tokenizer's few MB never wait)
DEFAULT_REFILL_S = 3600.0  # ... and a full budget again after this long
DEFERRED_LOGGED_EVERY = 1000  # requests over their budget are logged the first time and every this many
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


def _read(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


class Shelf:
    """What one PS serves its workers: manifests by bundle id, files by SHA-256 (see the module docstring)."""

    def __init__(self, copies: float = DEFAULT_COPIES, min_burst: int = DEFAULT_MIN_BURST_BYTES,
                 refill_s: float = DEFAULT_REFILL_S) -> None:
        self.manifests: dict[str, bytes] = {}  # bundle id -> the manifest's bytes
        self.files: dict[str, tuple[Path, int]] = {}  # a file's SHA-256 -> its path on this disk, its size
        self.sub = None  # the subscription to the workers' requests, from the first publish on
        self.sent = 0  # bytes of objects sent (tests and logs)
        self.copies, self.min_burst, self.refill_s = copies, min_burst, refill_s
        self.budgets = Budgets(min_burst, min_burst / refill_s)  # each worker id's (sized to what is served)
        self.deferred = 0  # requests told to ask again later (over their worker's budget)

    async def publish(self, bus: Bus, kind: str, files: list[Path], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> str:
        """Describe the files and serve them from now on; the bundle id."""
        bundle = await asyncio.to_thread(describe, kind, files, chunk_bytes)
        data = codec.encode(bundle, compress=False)
        bundle_id = hashlib.sha256(data).hexdigest()
        for entry, path in zip(bundle.files, files, strict=True):
            self.files[entry.sha256] = (path, entry.size)
        self.manifests[bundle_id] = data
        served = sum(len(m) for m in self.manifests.values()) + sum(size for _, size in self.files.values())
        self.budgets.burst = max(self.min_burst, self.copies * served)
        self.budgets.rate = self.budgets.burst / self.refill_s
        if self.sub is None:
            self.sub = await bus.serve(SUBJECT_MODELS_GET_ALL, ModelsGet, partial(self.answer, bus.max_payload),
                                       max_bytes=MAX_REQUEST_BYTES, reply_ok=partial(reply_refusal, SUBJECT_MODELS_GET),
                                       with_subject=True)
        log.info("bundle_published", kind=kind, bundle=bundle_id[:16], files=len(files),
                 bytes=sum(f.size for f in bundle.files))
        return bundle_id

    async def answer(self, max_payload: int, req: ModelsGet, subject: str) -> ModelsPart | None:
        """The part a request on `subject` asks for; None (silence) for an object this PS does not hold, or for
        a request over its worker's budget that does not wait (see the module docstring)."""
        manifest = self.manifests.get(req.sha256) if req.kind == "bundle" else None
        path, size = self.files.get(req.sha256, (None, 0)) if req.kind == "file" else (None, len(manifest or b""))
        if manifest is None and path is None:
            return None
        if req.offset >= size:
            return ModelsPart(sha256=req.sha256, offset=req.offset, size=size,
                              error=f"offset {req.offset} is past the end ({size} bytes)")
        n = min(req.length, max_payload - PART_ENVELOPE, size - req.offset)
        worker, now = requester(SUBJECT_MODELS_GET, subject), time.monotonic()
        cost = min(n, self.budgets.burst)  # (one part larger than the whole budget takes all of it)
        if wait := self.budgets.wait(worker, cost, now):
            self.deferred += 1
            if self.deferred == 1 or self.deferred % DEFERRED_LOGGED_EVERY == 0:
                log.warning("bundle_requests_deferred", worker=worker, deferred=self.deferred,
                            retry_after_s=round(wait, 1))
            return ModelsPart(sha256=req.sha256, offset=req.offset, size=size,
                              retry_after_s=min(wait, MAX_MODELS_RETRY_S)) if req.waits else None
        self.budgets.take(worker, cost, now)
        if manifest is not None:
            data = manifest[req.offset:req.offset + n]
        else:
            try:
                data = await asyncio.to_thread(_read, path, req.offset, n)
            except OSError as e:
                log.warning("bundle_file_unreadable", file=str(path), error=repr(e))
                return ModelsPart(sha256=req.sha256, offset=req.offset, size=size, error=f"unreadable at the PS: {e}")
        self.sent += len(data)
        return ModelsPart(sha256=req.sha256, offset=req.offset, size=size, data=data)


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

    def __init__(self, root: Path, worker_id: str, window: int = DEFAULT_WINDOW,
                 timeout_s: float = DEFAULT_PART_TIMEOUT_S, tries: int = DEFAULT_TRIES) -> None:
        self.root, self.worker_id = root.expanduser(), worker_id
        self.window, self.timeout_s, self.tries = window, timeout_s, tries
        self.verified: set[str] = set()  # checked in this process
        self.locks: dict[str, asyncio.Lock] = {}
        self.fetched = 0  # bytes fetched over the bus (tests and logs)
        self.deferred = 0  # answers that said to ask again later

    async def fetch(self, bus: Bus, bundle_id: str) -> Path:
        """The local directory of bundle `bundle_id`, fetched and verified if it is not cached intact."""
        if len(bundle_id) != 64 or not all(c in "0123456789abcdef" for c in bundle_id):
            raise CorruptBundle(f"{bundle_id[:80]!r} is not a bundle id")
        directory = self.root / bundle_id
        async with self.locks.setdefault(bundle_id, asyncio.Lock()):
            if bundle_id in self.verified:
                return directory
            self.root.mkdir(parents=True, exist_ok=True)
            # the other worker processes of this machine share the cache: one fetches, the others then find it
            async with AsyncFileLock(self.root / f"{bundle_id}.lock"):
                bundle = _cached(directory, bundle_id)
                if bundle is not None and await asyncio.to_thread(_intact, directory, bundle):
                    log.info("bundle_cached", bundle=bundle_id[:16], kind=bundle.kind)
                else:
                    await self._download(bus, bundle_id, directory)
            self.verified.add(bundle_id)
            return directory

    async def _download(self, bus: Bus, bundle_id: str, directory: Path) -> None:
        t0 = time.perf_counter()
        manifest = await self._manifest(bus, bundle_id)
        try:
            bundle = codec.decode(manifest, Bundle, MAX_MANIFEST_BYTES)
        except WireError as e:
            raise CorruptBundle(f"the manifest of bundle {bundle_id[:16]} is unreadable: {e}") from None
        part = self.root / f"{bundle_id}.part"
        await asyncio.to_thread(shutil.rmtree, part, True)
        part.mkdir(parents=True)
        for entry in bundle.files:
            out = _Verified(part / entry.name, entry)
            try:
                ask = ModelsGet(kind="file", sha256=entry.sha256, length=self._step(bus))
                await self._stream(bus, bundle_id, entry.name, ask, 0, entry.size, partial(asyncio.to_thread, out.write))
            except BaseException:
                out.abort()
                raise
            out.finish()
            self.fetched += entry.size
        (part / MANIFEST).write_bytes(manifest)
        await asyncio.to_thread(shutil.rmtree, directory, True)
        part.rename(directory)
        log.info("bundle_fetched", bundle=bundle_id[:16], kind=bundle.kind, files=len(bundle.files),
                 bytes=sum(f.size for f in bundle.files), seconds=round(time.perf_counter() - t0, 3))

    async def _manifest(self, bus: Bus, bundle_id: str) -> bytes:
        """The manifest's bytes, checked against the bundle id."""
        what = "its manifest"
        ask = ModelsGet(kind="bundle", sha256=bundle_id, length=self._step(bus))
        first = await self._part(bus, bundle_id, what, ask)
        if first.size > MAX_MANIFEST_BYTES:
            raise CorruptBundle(f"the manifest of bundle {bundle_id[:16]} is {first.size} bytes, over {MAX_MANIFEST_BYTES}")
        got = bytearray(first.data)

        async def keep(data: bytes) -> None:
            got.extend(data)

        await self._stream(bus, bundle_id, what, ask, len(got), first.size, keep)
        if hashlib.sha256(got).hexdigest() != bundle_id:
            raise CorruptBundle(f"the manifest of bundle {bundle_id[:16]} does not match its id")
        return bytes(got)

    def _step(self, bus: Bus) -> int:
        return max(1, min(bus.max_payload - PART_ENVELOPE, MAX_MODELS_PART_BYTES))

    async def _stream(self, bus: Bus, bundle_id: str, what: str, ask: ModelsGet, start: int, size: int,
                      write: Callable) -> None:
        """Bytes `start` to `size` of the object `ask` names, in order, into `write` (awaited), with up to
        `window` requests in flight."""
        step = self._step(bus)
        starts = iter(range(start, size, step))
        inflight: deque[asyncio.Task[bytes]] = deque()

        def more() -> None:
            at = next(starts, None)
            if at is not None:
                inflight.append(asyncio.create_task(self._range(bus, bundle_id, what, ask, at, min(step, size - at))))

        try:
            for _ in range(self.window):
                more()
            while inflight:
                data = await inflight.popleft()
                more()
                await write(data)
        finally:
            for task in inflight:
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)

    async def _range(self, bus: Bus, bundle_id: str, what: str, ask: ModelsGet, at: int, length: int) -> bytes:
        """`length` bytes from `at` (in several answers when the PS sends less at once)."""
        out = bytearray()
        while len(out) < length:
            req = ask.model_copy(update={"offset": at + len(out), "length": length - len(out)})
            part = await self._part(bus, bundle_id, what, req)
            if not part.data:
                raise CorruptBundle(f"{what} of bundle {bundle_id[:16]} ends at byte {req.offset} at the PS")
            out += part.data
        return bytes(out)

    async def _part(self, bus: Bus, bundle_id: str, what: str, req: ModelsGet) -> ModelsPart:
        """One request's answer, tried `tries` times; `BundleUnavailable` when no PS answers. Told to ask again
        later (over this worker's budget at the PS), it waits and asks again: no failed try."""
        subject, delay, why, attempt = SUBJECT_MODELS_GET.format(worker_id=self.worker_id), 0.5, "", 0
        req = req.model_copy(update={"waits": True})
        while attempt < self.tries:
            try:
                part = await bus.request(subject, req, ModelsPart, timeout_s=self.timeout_s,
                                         max_bytes=MAX_MODELS_PART_BYTES + PART_ENVELOPE)
            except (*TRANSIENT, WireError) as e:
                why, attempt = str(e) or type(e).__name__, attempt + 1
                if attempt < self.tries:
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 4.0)
                continue
            if part.retry_after_s and not part.data and not part.error:
                self.deferred += 1
                if self.deferred == 1 or self.deferred % DEFERRED_LOGGED_EVERY == 0:  # (why a fetch is slow)
                    log.warning("bundle_fetch_waits", bundle=bundle_id[:16], what=what, deferred=self.deferred,
                                retry_after_s=round(part.retry_after_s, 1),
                                why="this worker drew its budget of the PS's bytes")
                await asyncio.sleep(part.retry_after_s)
                continue
            if part.error:
                raise BundleUnavailable(f"bundle {bundle_id[:16]}: the PS cannot send {what}: {part.error}")
            if part.sha256 != req.sha256 or part.offset != req.offset or len(part.data) > req.length:
                raise CorruptBundle(f"bundle {bundle_id[:16]}: the answer for {what} is not the part asked for")
            return part
        raise BundleUnavailable(f"bundle {bundle_id[:16]}: no PS answered for {what} on {subject} ({self.tries} "
                                f"tries, the last: {why}); is the job's PS running?")
