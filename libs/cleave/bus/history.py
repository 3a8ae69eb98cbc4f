"""What a JetStream stream holds, read once: every message on a subject (a wildcard too), or each subject's last,
oldest first, by a consumer of its own that the server deletes soon after the read (`cleave status`, `follow`,
forgetting a job)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from cleave import codec
from cleave.bus import DEFAULT_TIMEOUT_S
from cleave.errors import WireError
from cleave.schemas import MAX_CONTROL_BYTES
from cleave.schemas.base import Wire

T = TypeVar("T", bound=Wire)
FETCH = 512  # messages read per batch
CONSUMER_IDLE_S = 30.0  # the server deletes a reading consumer this long after its last use
FETCH_WAIT_S = 2.0  # a batch that has not come by then: nothing (more) there


async def read(js: JetStreamContext, stream: str, subject: str, schema: type[T], policy: DeliverPolicy) -> list[T]:
    """The messages of `stream` on `subject` that `policy` delivers (all, or each subject's last), oldest first;
    one that does not decode as `schema` (a deletion's marker, too) is skipped."""
    return [found for _, found in await numbered(js, stream, subject, schema, policy)]


async def numbered(js: JetStreamContext, stream: str, subject: str, schema: type[T],
                   policy: DeliverPolicy, after: int = 0) -> list[tuple[int, T]]:
    """`read`'s messages, each with its sequence number in the stream; with `after`, only those past that
    sequence number (`policy` aside: what came since an earlier read)."""
    found: list[tuple[int, T]] = []
    async for m in messages(js, stream, subject, policy, after):
        with contextlib.suppress(WireError):
            found.append((m.metadata.sequence.stream, codec.decode(m.data, schema, MAX_CONTROL_BYTES)))
    return found


async def messages(js: JetStreamContext, stream: str, subject: str, policy: DeliverPolicy,
                   after: int = 0) -> AsyncIterator[Msg]:
    """The messages of `stream` on `subject` that `policy` delivers (with `after`: those past that sequence
    number), oldest first, as they are fetched (none when there is no such stream: no hub, nor stack, ever ran
    on this server)."""
    if after:
        policy = DeliverPolicy.BY_START_SEQUENCE
    config = ConsumerConfig(deliver_policy=policy, opt_start_seq=after + 1 if after else None,
                            ack_policy=AckPolicy.NONE, inactive_threshold=CONSUMER_IDLE_S)
    try:
        sub = await asyncio.wait_for(js.pull_subscribe(subject, stream=stream, config=config), DEFAULT_TIMEOUT_S)
    except NotFoundError:
        return
    try:
        if not (await sub.consumer_info()).num_pending:
            return  # none (a fetch would wait out its timeout)
        while True:
            try:
                msgs = await sub.fetch(FETCH, timeout=FETCH_WAIT_S)
            except TimeoutError:
                break
            for m in msgs:
                yield m
            if msgs[-1].metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
