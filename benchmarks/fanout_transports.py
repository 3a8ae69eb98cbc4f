"""How to fan a block out to several workers: the candidates measured side by side on loopback.

One publisher connection (the PS) and N subscriber connections (workers) on one nats-server. Each
candidate delivers `--blocks` blocks of `--size` bytes to every subscriber; the figure is the time until
the last subscriber has the last block, and the bytes the publisher sent (its connection's `in_bytes` in
the server's `/connz`):
- `direct`: one publish per subscriber on its own subject (what the PS did before fan-out),
- `subject`: one publish on a subject all N subscribe to (core NATS fan-out; what the PS does now),
- `jetstream`: one publish into a memory stream, one ordered consumer per subscriber.
Writes benchmarks/results/fanout_transports.json.

    .venv/bin/python benchmarks/fanout_transports.py [--subscribers 4,16] [--size 1048576] [--blocks 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from nats.js.api import StorageType, StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages
from benchmarks.fanout import Nats  # noqa: E402
from cleave import bus as busmod  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "fanout_transports.json"
CHUNK = 1024 * 1024 - 8192  # under the default max_payload


async def deliver(kind: str, nats: Nats, subscribers: int, size: int, blocks: int) -> dict:
    pub = await busmod.connect(nats.url, f"pub-{kind}")
    subs = [await busmod.connect(nats.url, f"sub-{kind}-{i}") for i in range(subscribers)]
    got = [0] * subscribers
    done = asyncio.Event()
    parts = -(-size // CHUNK)
    payload = bytes(-(-size // parts))

    def counter(i: int):
        async def on(msg) -> None:  # noqa: ANN001
            got[i] += len(msg.data)
            if all(g >= size * blocks for g in got):
                done.set()
            if kind == "jetstream":
                await msg.ack()
        return on

    handles = []
    if kind == "jetstream":
        await pub.js.add_stream(StreamConfig(name="FANBENCH", subjects=["fanbench.>"], storage=StorageType.MEMORY))
    for i, s in enumerate(subs):
        subject = f"fanbench.{i}" if kind == "direct" else "fanbench.all"
        if kind == "jetstream":
            handles.append(await s.js.subscribe(subject, cb=counter(i), ordered_consumer=True))
        else:
            handles.append(await s.nc.subscribe(subject, cb=counter(i)))
        await s.nc.flush()
    before = {c["name"]: c["in_bytes"] for c in nats.connz()}
    start = time.perf_counter()
    for _ in range(blocks):
        for _ in range(parts):
            if kind == "direct":
                for i in range(subscribers):
                    await pub.nc.publish(f"fanbench.{i}", payload)
            elif kind == "subject":
                await pub.nc.publish("fanbench.all", payload)
            else:
                await pub.js.publish("fanbench.all", payload, timeout=30)
    await pub.nc.flush()
    await asyncio.wait_for(done.wait(), 300)
    seconds = time.perf_counter() - start
    sent = next(c["in_bytes"] for c in nats.connz() if c["name"] == f"pub-{kind}") - before.get(f"pub-{kind}", 0)
    if kind == "jetstream":
        await pub.js.delete_stream("FANBENCH")
    for s in (pub, *subs):
        await s.close()
    delivered = size * blocks * subscribers
    return {"kind": kind, "subscribers": subscribers, "block_bytes": size, "blocks": blocks, "seconds": seconds,
            "publisher_bytes": sent, "publisher_over_block_bytes": sent / (size * blocks),
            "delivered_mb_per_s": delivered / seconds / 1e6}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--subscribers", default="4,16")
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--blocks", type=int, default=32)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="cleave-fanbench-") as tmp:
        nats = Nats(Path(tmp))
        try:
            for n in [int(x) for x in args.subscribers.split(",")]:
                for kind in ("direct", "subject", "jetstream"):
                    row = await deliver(kind, nats, n, args.size, args.blocks)
                    rows.append(row)
                    print(f"{n:3d} subscribers {kind:9s}: {row['seconds']:6.2f} s, {row['delivered_mb_per_s']:7.0f} MB/s "
                          f"delivered, the publisher sent {row['publisher_over_block_bytes']:5.2f}x the blocks")
        finally:
            nats.stop()
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    asyncio.run(main())
