"""Fan-out of live updates to the pages watching, as server-sent-event frames, with bounded memory.

Each watcher has a bounded queue. A watcher that falls that far behind is cut off rather than let
memory grow: its stream ends, the browser's EventSource reconnects and starts again from a snapshot.
"""

from __future__ import annotations

import asyncio
import json

DEFAULT_QUEUE = 1024  # frames a watcher may fall behind before it is cut off


def frame(kind: str, data: object) -> bytes:
    """One server-sent event: `event: kind` and its JSON data on one line."""
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Watcher:
    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(size)
        self.cut_off = False

    def end(self) -> None:
        """Make `next()` return None once the frames already queued are gone (or at once if full)."""
        if self.queue.full():
            while not self.queue.empty():
                self.queue.get_nowait()
        self.queue.put_nowait(None)

    async def next(self) -> bytes | None:
        return await self.queue.get()


class Hub:
    def __init__(self, queue_size: int = DEFAULT_QUEUE) -> None:
        self.queue_size = queue_size
        self.watchers: set[Watcher] = set()
        self.cut_offs = 0  # watchers dropped for falling behind
        self.closed = False

    def join(self) -> Watcher:
        w = Watcher(self.queue_size)
        if self.closed:
            w.end()
        else:
            self.watchers.add(w)
        return w

    def leave(self, w: Watcher) -> None:
        self.watchers.discard(w)

    def publish(self, kind: str, data: object) -> None:
        """Queue one event for every watcher (encoded once); cut off those that are full."""
        if not self.watchers:
            return
        f = frame(kind, data)
        for w in list(self.watchers):
            if w.queue.qsize() >= self.queue_size - 1:  # keep one slot for the end marker
                w.cut_off = True
                self.cut_offs += 1
                self.watchers.discard(w)
                w.end()
            else:
                w.queue.put_nowait(f)

    def close(self) -> None:
        """End every stream (at shutdown)."""
        self.closed = True
        for w in self.watchers:
            w.end()
        self.watchers.clear()
