"""The only user of nats-py besides tests: connect, publish and subscribe messages, JetStream set-up.

Every publish goes through the codec and is chunked so that no NATS message exceeds the server's
`max_payload` (the server closes the whole connection otherwise). Every network await has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import secrets
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import SlowConsumerError
from nats.js.api import DeliverPolicy, KeyValueConfig, ObjectStoreConfig, StorageType, StreamConfig
from nats.js.errors import (
    BadRequestError,
    KeyNotFoundError,
    KeyValueError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from cleave import codec
from cleave.bus import create, direct, receive, urls
from cleave.bus.limits import BUCKET_LIMITS, DEFAULT_BUCKET_LIMITS, EVENTS_MAX_BYTES, HEADROOM
from cleave.bus.stopping import done_unless_stopped
from cleave.errors import CleaveError, Conflict, WireError
from cleave.schemas import (
    EVENTS_STREAM,
    MAX_CONTROL_BYTES,
    MAX_MESSAGE_BYTES,
    PLAN_BUCKET,
    REGISTRY_BUCKET,
    STATE_BUCKET,
    SUBJECT_EVENTS_ALL,
    WORKER_REPLY_TOKEN,
    Event,
    StepMetrics,
    Wire,
    event_kind,
    event_subject,
)
from cleave.schemas.subjects import kv_subject

log = structlog.get_logger("cleave.bus")
T = TypeVar("T", bound=Wire)
R = TypeVar("R")

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_RECONNECT_WAIT_S = 0.5
DEFAULT_PENDING_BYTES = 512 << 20  # per subscription; past it nats-py drops (a dropped tile is re-sent)
DEFAULT_REGISTRY_TTL_S = 10.0  # registry entries outlive a missed heartbeat or two, then vanish
DEFAULT_WATCH_POLL_S = 0.5
ELECTION_S = 30.0  # a stream that lost its leader elects one in seconds: `Bus.patiently` retries this long
TRANSIENT = (TimeoutError, nats.errors.NoRespondersError, ServiceUnavailableError)  # what an election looks like
NO_RESPONDERS = "503"  # the status nats-server answers a request with when nobody subscribes
OFF_LOOP_BYTES = 1 << 20  # a received message larger than this is decoded in a worker thread
MAX_REPLICAS = 3  # JetStream replicas of every stream, KV bucket and object store on a cluster (R3)


class Bus:
    """A connected NATS client with the codec applied: typed publish/subscribe, events, KV helpers."""

    def __init__(self, nc: Client, name: str) -> None:
        self.nc, self.name = nc, name
        self.js = nc.jetstream(timeout=DEFAULT_TIMEOUT_S)
        self.rejected: dict[str, int] = {}  # reason -> count of messages refused on receipt
        self.on_dropped: list[Callable[[str], None]] = []  # told the subject of a message dropped unread
        self.watch_retries = 0  # watches that failed to be set up again after a reconnect (and were retried)
        self.retries = 0  # requests `patiently` tried again
        self.closing = False  # set by close(): the disconnection that follows is expected
        self.replicas = replicas_of(nc)  # of what setup, kv and object_store create
        self._replies: str | None = None  # the subject prefix `request`'s answers come on (made on first use)
        self._waiting: dict[str, asyncio.Future[Msg]] = {}  # request token -> its answer


    @property
    def reconnects(self) -> int:
        return self.nc.stats["reconnects"]

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload - HEADROOM

    async def publish(self, subject: str, msg: Wire, compress: bool = True) -> int:
        """Encode, chunk and publish; returns the bytes put on the wire. Uncompressed, a message's large
        values (a tensor's data) go to the socket as they are (`codec.encode_pieces`), not copied into a frame."""
        if not compress:
            return await self.publish_pieces(subject, codec.encode_pieces(msg))
        return await self.publish_frame(subject, codec.encode(msg, compress))

    async def publish_frame(self, subject: str, frame: bytes) -> int:
        return await self.publish_pieces(subject, [frame])

    async def publish_pieces(self, subject: str, pieces: list[codec.Piece], wait: bool = True) -> int:
        """Publish the frame that `pieces` make (`codec.encode_pieces`) in chunks of at most `max_payload`,
        never joined (`direct.publish`); returns the bytes put on the wire. `wait=False`: return once written;
        `settled()` waits until the kernel has it, and its pieces must not change until then."""
        return await direct.publish(self.nc, subject, pieces, self.max_payload, DEFAULT_TIMEOUT_S, wait)

    async def settled(self) -> None:
        """Until the kernel has every message published so far (those published with `wait=False` together)."""
        await direct.settled(self.nc, DEFAULT_TIMEOUT_S)

    def reject(self, reason: str, subject: str, detail: str = "") -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        log.warning("message_rejected", reason=reason, subject=subject, detail=detail[:200], service=self.name)

    async def subscribe(self, subject: str, schema: type[T], handler: Callable[[T, int], Awaitable[None]],
                        queue: str = "", max_bytes: int = MAX_MESSAGE_BYTES,
                        pending_bytes: int = DEFAULT_PENDING_BYTES, sender: str = "", compressed: bool = True,
                        cap: Callable[[], int] | None = None):  # noqa: ANN201 - nats-py's Subscription
        """Subscribe with reassembly and validation; `handler(msg, wire_bytes)` sees only valid messages.

        With `sender` (a field name, e.g. "worker_id"), a message whose field differs from the last token of
        the subject it came on is rejected (`wrong_sender`): per-worker subjects, which per-worker credentials
        restrict, then also bind the id a message claims. `cap`, asked for each message, lowers `max_bytes` to
        the largest a sender can rightly send now; `compressed=False` refuses zstd bodies. Chunks are reassembled
        per subject (`codec.Reassembler`), and a message over OFF_LOOP_BYTES is decoded in a thread."""
        reasm = codec.Reassembler(max_bytes=max_bytes)  # partial messages: at most 2 x max_bytes held

        async def on_msg(m: Msg) -> None:
            limit = max_bytes if cap is None else min(max_bytes, cap())
            try:
                frame = reasm.feed(m.data, m.subject, limit)
                if frame is None:
                    return
                if len(frame) > OFF_LOOP_BYTES:
                    msg = await asyncio.to_thread(codec.decode, frame, schema, limit, compressed)
                else:
                    msg = codec.decode(frame, schema, limit, compressed)
            except WireError as e:
                self.reject(e.reason, m.subject, str(e))
                return
            if sender and getattr(msg, sender) != m.subject.rsplit(".", 1)[-1]:
                self.reject("wrong_sender", m.subject, f"{sender}={getattr(msg, sender)!r}")
                return
            nbytes = len(frame)
            del frame  # decoded: the frame's bytes are not kept while the handler runs (a tile computes meanwhile)
            await handler(msg, nbytes)

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg, pending_bytes_limit=pending_bytes,
                                      pending_msgs_limit=-1)
        receive.hand_views(self.nc, sub._id)  # on_msg reads a large message where it arrived, and lets it go
        return sub

    # ---- JetStream -----------------------------------------------------------------------------------
    async def setup(self, registry_ttl_s: float = DEFAULT_REGISTRY_TTL_S) -> None:
        """Create the stream and buckets every service relies on; safe to call again and concurrently."""
        await self.stream(StreamConfig(
            name=EVENTS_STREAM, subjects=[SUBJECT_EVENTS_ALL], storage=StorageType.FILE,
            max_bytes=EVENTS_MAX_BYTES, max_msg_size=MAX_CONTROL_BYTES, num_replicas=self.replicas,
        ))
        await self.kv(REGISTRY_BUCKET, ttl_s=registry_ttl_s)
        await self.kv(PLAN_BUCKET, history=5)
        await self.kv(STATE_BUCKET, history=5)

    async def stream(self, config: StreamConfig) -> None:
        """The stream, created when missing with `config`."""
        await create.ensure(lambda: self.js.stream_info(config.name), lambda: self.js.add_stream(config),
                            f"stream {config.name}", config.max_bytes, DEFAULT_TIMEOUT_S)

    async def kv(self, bucket: str, ttl_s: float | None = None, history: int = 1) -> KeyValue:
        """The bucket, created when missing with its limits (`BUCKET_LIMITS`)."""
        value_bytes, total_bytes = BUCKET_LIMITS.get(bucket, DEFAULT_BUCKET_LIMITS)
        config = KeyValueConfig(bucket=bucket, ttl=ttl_s, history=history, replicas=self.replicas,
                                max_value_size=value_bytes, max_bytes=total_bytes)
        return await create.ensure(lambda: self.js.key_value(bucket), lambda: self.js.create_key_value(config),
                                   f"KV bucket {bucket}", total_bytes, DEFAULT_TIMEOUT_S)

    async def patiently(self, call: Callable[[], Awaitable[R]], what: str, budget_s: float = ELECTION_S) -> R:
        """`call()` (each try bounded by DEFAULT_TIMEOUT_S) retried on the errors of a stream electing a
        leader (`TRANSIENT`) until it succeeds or `budget_s` has passed; then the last error is raised. Only
        for calls that may run twice (reads, or writes whose second try detects the first)."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + budget_s, 0.25
        while True:
            try:
                return await asyncio.wait_for(call(), DEFAULT_TIMEOUT_S)
            except TRANSIENT as e:
                if loop.time() + delay >= deadline:
                    raise
                self.retries += 1
                log.warning("bus_retried", what=what, reason=type(e).__name__, retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)

    async def kv_get(self, kv: KeyValue, key: str, schema: type[T],
                     max_bytes: int = MAX_CONTROL_BYTES) -> tuple[T, int] | None:
        """The decoded value and its revision, or None when absent (or unreadable, which is logged);
        `max_bytes` bounds the value once decompressed (MAX_PLAN_BYTES for a Plan)."""
        try:
            entry = await asyncio.wait_for(kv.get(key), DEFAULT_TIMEOUT_S)
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        try:
            return codec.decode(entry.value, schema, max_bytes), entry.revision
        except WireError as e:
            self.reject(e.reason, f"kv:{kv._name}.{key}", str(e))
            return None

    async def keys(self, kv: KeyValue) -> list[str]:
        """The bucket's keys, sorted ([] when it is empty): each key holding a message, a value or the marker of a
        deletion (`kv_get` returns None for that one). Read in one request from the stream's own list of subjects:
        nats-py's `kv.keys()` lists them with a watch that can end before its first key on a busy server (its
        consumer has sent the keys, its client has not counted one yet) and then says the bucket is empty."""
        prefix = kv_subject(kv._name, "")
        info = await self.patiently(lambda: self.js.stream_info(kv._stream, subjects_filter=f"{prefix}>"), "keys")
        return sorted(s.removeprefix(prefix) for s in info.state.subjects or {})

    async def history(self, kv: KeyValue, key: str, upto: int) -> list[tuple[int, bytes]]:
        """The revisions of one key that the bucket keeps, up to revision `upto`, oldest first: (revision,
        value), a deletion's value empty. Read one message at a time ("the next message on this subject from
        this sequence on"): nats-py's `kv.history()` reads them with a watch that can end before its first entry
        on a busy machine and then says there is no history."""
        subject, found, seq = kv_subject(kv._name, key), [], 1
        while seq <= upto:
            try:
                msg = await self.patiently(lambda s=seq: self.js.get_msg(kv._stream, s, subject, next=True), "history")
            except NotFoundError:
                break
            if msg.seq > upto:
                break
            found.append((msg.seq, msg.data or b""))
            seq = msg.seq + 1
        return found

    async def kv_put(self, kv: KeyValue, key: str, msg: Wire) -> int:
        return await asyncio.wait_for(kv.put(key, codec.encode(msg)), DEFAULT_TIMEOUT_S)

    async def kv_swap(self, kv: KeyValue, key: str, value: bytes, last: int | None) -> int:
        """Compare-and-set: create when `last` is None, else update only from revision `last`.

        Raises Conflict when another writer got there first."""
        try:
            if last is None:
                return await asyncio.wait_for(kv.create(key, value), DEFAULT_TIMEOUT_S)
            return await asyncio.wait_for(kv.update(key, value, last=last), DEFAULT_TIMEOUT_S)
        except (KeyWrongLastSequenceError, KeyValueError, BadRequestError) as e:
            raise Conflict(f"{key}: {e}") from None

    async def watch(self, bucket: str, key: str, on_entry: Callable[[str, str, bytes | None], object],
                    stop: asyncio.Event) -> None:
        """Feed every current and later entry of `key` (`>` for all) to `on_entry(key, operation, value)`
        (awaited if it returns an awaitable) until `stop` is set."""
        kv = await self.kv(bucket)
        watcher = await asyncio.wait_for(kv.watch(key), DEFAULT_TIMEOUT_S)
        seen_reconnects = self.reconnects
        try:
            while not stop.is_set():
                if self.reconnects != seen_reconnects and self.nc.is_connected:
                    # the server may have restarted: a fresh watch replays the current value, then follows
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(watcher.stop(), DEFAULT_TIMEOUT_S)
                    watcher = await self._rewatch(kv, bucket, key, stop)
                    seen_reconnects = self.reconnects
                    if watcher is None:
                        return
                try:
                    entry = await watcher.updates(timeout=DEFAULT_WATCH_POLL_S)
                except TimeoutError:
                    continue
                if entry is None:  # marks the end of the initial values
                    continue
                result = on_entry(entry.key, entry.operation or "PUT", entry.value)
                if inspect.isawaitable(result):
                    await result
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watcher.stop(), DEFAULT_TIMEOUT_S)

    async def _rewatch(self, kv: KeyValue, bucket: str, key: str, stop: asyncio.Event):  # noqa: ANN202
        """A new watch of `key` after a reconnect, retried until it is set up or `stop` (then None): on a
        cluster that lost a node, the bucket's stream may still be electing a leader (seconds)."""
        while not stop.is_set():
            try:
                return await asyncio.wait_for(kv.watch(key), DEFAULT_TIMEOUT_S)
            except (TimeoutError, nats.errors.Error) as e:
                self.watch_retries += 1
                log.warning("watch_retried", bucket=bucket, key=key, reason=type(e).__name__)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), DEFAULT_WATCH_POLL_S)
        return None

    async def follow(self, stream: str, subject: str, on_msg: Callable[[str, bytes], object],
                     stop: asyncio.Event) -> None:
        """Read a stream from its first message, then follow it (ordered, ephemeral consumer)."""

        async def cb(msg: Msg) -> None:
            on_msg(msg.subject, msg.data)

        sub = await asyncio.wait_for(
            self.js.subscribe(subject, stream=stream, cb=cb, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL),
            DEFAULT_TIMEOUT_S,
        )
        await stop.wait()
        with contextlib.suppress(Exception):  # the connection may already be gone at shutdown
            await asyncio.wait_for(sub.unsubscribe(), DEFAULT_TIMEOUT_S)

    async def object_store(self, bucket: str, max_bytes: int | None = None) -> ObjectStore:
        """The object store, created when missing (`max_bytes`: its size limit; None: the server's JetStream
        limit); each object travels in chunks of at most `max_payload`."""
        config = ObjectStoreConfig(bucket=bucket, replicas=self.replicas, max_bytes=max_bytes or -1)
        return await create.ensure(lambda: self.js.object_store(bucket),
                                   lambda: self.js.create_object_store(bucket, config), f"object store {bucket}",
                                   max_bytes, DEFAULT_TIMEOUT_S)

    async def request(self, subject: str, msg: Wire, schema: type[T], timeout_s: float = DEFAULT_TIMEOUT_S,
                      max_bytes: int = MAX_MESSAGE_BYTES) -> T:
        """Request/reply with one-message frames (both sides must fit `max_payload`). Answers come on
        `<inbox prefix>.w.<128 random bits>.<128 random bits per request>`, one wildcard subscription per client:
        a site's leaf node may publish below `.w.` and nowhere else among this client's replies (`cleave.auth`,
        role "site"), and cannot guess the name of a request it was not sent."""
        if self._replies is None:
            self._replies = f"{self.nc.new_inbox().rpartition('.')[0]}.{WORKER_REPLY_TOKEN}.{secrets.token_hex(16)}"
            await self.nc.subscribe(self._replies + ".*", cb=self._on_reply)
        token = secrets.token_hex(16)
        self._waiting[token] = answer = asyncio.get_running_loop().create_future()
        try:
            await self.nc.publish(subject, codec.encode(msg, compress=False), reply=f"{self._replies}.{token}")
            reply = await asyncio.wait_for(answer, timeout_s)
        finally:
            self._waiting.pop(token, None)
        if reply.headers and reply.headers.get("Status") == NO_RESPONDERS:  # the server: nobody subscribes
            raise nats.errors.NoRespondersError
        return codec.decode(reply.data, schema, max_bytes)

    async def _on_reply(self, m: Msg) -> None:
        answer = self._waiting.pop(m.subject.rsplit(".", 1)[-1], None)
        if answer is not None and not answer.done():  # a second or late answer is dropped
            answer.set_result(m)

    async def serve(self, subject: str, schema: type[T], handler: Callable[..., Awaitable[Wire | None]],
                    max_bytes: int = MAX_CONTROL_BYTES, reply_ok: Callable[[str, str], str] | None = None,
                    with_subject: bool = False):
        """Answer requests on `subject`: valid ones get `handler`'s reply (`handler(msg)`, or `handler(msg,
        subject)` `with_subject`; None: no answer), invalid ones are rejected. A request names its own reply
        subject and the answer goes out with this connection's rights: `reply_ok(subject, reply)` says why a
        reply subject must not be answered ('' when it may), checked before anything is decoded."""

        async def cb(m: Msg) -> None:
            if reply_ok is not None and (why := reply_ok(m.subject, m.reply or "")):
                self.reject("reply_refused", m.subject, f"{why}: {(m.reply or '')[:200]}")
                return
            try:
                msg = codec.decode(m.data, schema, max_bytes)
            except WireError as e:
                self.reject(e.reason, m.subject, str(e))
                return
            answer = await (handler(msg, m.subject) if with_subject else handler(msg))
            if answer is not None:
                await m.respond(codec.encode(answer, compress=False))

        return await self.nc.subscribe(subject, cb=cb)

    async def emit(self, msg: Event | StepMetrics) -> None:
        """Persist an event or a step's metrics in the events stream (the monitor's history)."""
        try:
            await self.js.publish(event_subject(msg), codec.encode(msg), timeout=DEFAULT_TIMEOUT_S)
        except Exception as e:  # the bus being down must not stop training; the event is logged instead
            log.warning("event_not_stored", kind=event_kind(msg), job=msg.job, error=repr(e))

    async def close(self) -> None:
        """Drain and close; the disconnection this causes is not reported as a warning."""
        self.closing = True
        try:
            await asyncio.wait_for(self.nc.drain(), DEFAULT_TIMEOUT_S)
        except Exception:  # (a connection lost meanwhile cannot drain, and its close raises too)
            await asyncio.gather(self.nc.close(), return_exceptions=True)


def replicas_of(nc: Client) -> int:
    """R3 on a cluster of three or more servers, else as many as it has: the servers this client knows
    (the URLs it was given and those the cluster advertised), capped at `MAX_REPLICAS`."""
    info = getattr(nc, "_server_info", None) or {}
    if not info.get("cluster"):
        return 1
    urls = {str(u) for u in info.get("connect_urls") or []}
    return max(1, min(MAX_REPLICAS, len(urls) or 1, len(nc.servers)))


async def connect(url: str, name: str, connect_timeout_s: float = 2.0, stop: asyncio.Event | None = None,
                  **options) -> Bus | None:
    """Connect with unlimited reconnects; the first connection is retried with back-off until it works, or
    (given `stop`) until `stop` is set: then None, a service asked to stop before NATS ever answered."""
    delay = 0.2
    made: list[Bus] = []  # the Bus, once connected, for the callbacks
    said: list[str] = []  # the error last logged while not connected: the same again (each retry's) is not

    async def on_error(e: Exception) -> None:
        if isinstance(e, SlowConsumerError) and made:  # a message was dropped unread: whoever waits for it
            for handler in made[0].on_dropped:           # hears now, not at a deadline
                handler(e.subject)
        if made and made[0].closing:
            log.debug("nats_error_while_closing", service=name, error=repr(e))
        elif said != [repr(e)] or (made and made[0].nc.is_connected):
            said[:] = [repr(e)]
            log.warning("nats_error", service=name, error=repr(e))

    async def on_disconnected() -> None:
        if made and not made[0].closing:  # (our own close is no news, nor a connection never made)
            log.warning("nats_disconnected", service=name)

    async def on_reconnected() -> None:
        said.clear()
        log.info("nats_reconnected", service=name)

    servers = urls.servers(url)  # a cluster: several URLs; a wrong one is refused here, not retried
    while True:
        try:
            nc = receive.client()
            connecting = nc.connect(
                servers, name=name, connect_timeout=connect_timeout_s, max_reconnect_attempts=-1,
                reconnect_time_wait=DEFAULT_RECONNECT_WAIT_S, allow_reconnect=True,
                error_cb=on_error, disconnected_cb=on_disconnected, reconnected_cb=on_reconnected,
                flush_timeout=DEFAULT_TIMEOUT_S, **options,
            )
            if not await done_unless_stopped(connecting, stop):  # (nats-py retries inside connect)
                await asyncio.gather(nc.close(), return_exceptions=True)
                return None
            made.append(Bus(nc, name))
            return made[0]
        except Exception as e:
            if "authorization violation" in str(e).lower():  # retrying cannot fix wrong credentials
                raise CleaveError(f"NATS at {url} refused {name}'s credentials: {e}") from None
            log.warning("nats_unreachable", service=name, url=url, error=repr(e), retry_in_s=round(delay, 2))
            if not await done_unless_stopped(asyncio.sleep(delay), stop):
                return None
            delay = min(delay * 2, 5.0)
