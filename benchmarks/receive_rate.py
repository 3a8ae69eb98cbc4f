"""The CPU a received byte costs a subscriber on a real connection: nats-py's client against Cleave's
(`cleave.bus.receive.client`: its parser and transport), side by side in one run, on the same messages from the
same publisher (a nats-py process) through one local nats-server. The subscriber's process time while the
messages arrive, over the bytes received; alternated, the median of `--rounds` each.

    .venv/bin/python benchmarks/receive_rate.py [--mib 4] [--messages 200] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats

from cleave.api.natsconf import free_port, nats_server_binary
from cleave.bus import receive

SUBJECT = "rate.rx"
MAX_PAYLOAD = 8 * 1024 * 1024


async def publish(url: str, size: int, messages: int) -> None:
    nc = await nats.connect(url)
    blob = os.urandom(size)
    for i in range(messages):
        await nc.publish(SUBJECT, blob)
        if i % 8 == 7:
            await nc.flush()
    await nc.flush()
    await nc.close()


async def ns_a_byte(url: str, client: nats.NATS, size: int, messages: int) -> dict:
    await client.connect(url)
    got, done = 0, asyncio.Event()

    async def on_msg(m) -> None:  # noqa: ANN001
        nonlocal got
        got += len(m.data)
        if got == size * messages:
            done.set()

    await client.subscribe(SUBJECT, cb=on_msg, pending_bytes_limit=4 * size * messages)
    await client.flush()
    pub = await asyncio.create_subprocess_exec(sys.executable, __file__, "--publish", url, str(size), str(messages))
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        await asyncio.wait_for(done.wait(), 300)
    finally:
        c1, t1 = time.process_time(), time.perf_counter()
        await asyncio.wait_for(pub.wait(), 60)
        await client.close()
    return {"ns_a_byte": 1e9 * (c1 - c0) / got, "seconds": t1 - t0}


async def measure(url: str, size: int, messages: int, rounds: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {"nats-py": [], "cleave": []}
    for _ in range(rounds):
        for name, make in (("nats-py", nats.NATS), ("cleave", receive.client)):
            runs[name].append(await ns_a_byte(url, make(), size, messages))
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=4, help="each message's size")
    p.add_argument("--messages", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="write the figures here (JSON)")
    args = p.parse_args()
    size = int(args.mib * 2**20)
    port, store = free_port(), Path(tempfile.mkdtemp(prefix="receive-rate-"))
    conf = store / "nats.conf"
    conf.write_text(f"listen: 127.0.0.1:{port}\nmax_payload: {MAX_PAYLOAD}\nmax_pending: {4 * MAX_PAYLOAD * 8}\n")
    server = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"nats://127.0.0.1:{port}"
    try:
        time.sleep(1.0)  # (the server is up well within this)
        runs = asyncio.run(measure(url, size, args.messages, args.rounds))
    finally:
        server.terminate()
    med = {name: statistics.median(r["ns_a_byte"] for r in rs) for name, rs in runs.items()}
    out = {"message_bytes": size, "messages": args.messages, "rounds": args.rounds,
           "nats_py_ns_a_byte": med["nats-py"], "cleave_ns_a_byte": med["cleave"],
           "nats_py_over_cleave": med["nats-py"] / med["cleave"], "runs": runs,
           "load_average_1min_at_end": os.getloadavg()[0]}
    for name, v in med.items():
        print(f"{name:8s} {v:.3f} ns a received byte (median of {args.rounds})")
    print(f"nats-py / cleave: {out['nats_py_over_cleave']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--publish"]:
        asyncio.run(publish(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    else:
        main()
