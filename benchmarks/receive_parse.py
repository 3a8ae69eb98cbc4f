"""The CPU a byte of parsing received NATS messages: nats-py's parser against the one that gathers a large payload in
place (`cleave.bus.receive`), side by side on the same bytes, fed as the socket delivers them (32 KiB reads).

    .venv/bin/python benchmarks/receive_parse.py [--mib 4] [--messages 20] [--read-kib 32] [--runs 3] [--out FILE]

Writes benchmarks/results/receive_parse.json: each run's ns a byte of both parsers (CPU time of this process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path

from nats.protocol.parser import Parser as NatsParser

from cleave.bus import receive

OUT = Path(__file__).resolve().parent / "results" / "receive_parse.json"


class Conn:
    def __init__(self) -> None:
        self.bytes = 0

    async def _process_msg(self, sid, subject, reply, payload, hdr) -> None:  # noqa: ANN001
        self.bytes += len(payload)


async def seconds(parser_class: type, reads: list[bytes], expect: int) -> float:
    conn = Conn()
    parser = parser_class(conn)
    t0 = time.process_time()
    for r in reads:
        await parser.parse(r)
    dt = time.process_time() - t0
    assert conn.bytes == expect, f"{parser_class.__module__} delivered {conn.bytes} of {expect} bytes"
    return dt


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=4, help="each message's size")
    p.add_argument("--messages", type=int, default=20)
    p.add_argument("--read-kib", type=int, default=32, help="the size of each read (nats-py reads 32 KiB)")
    p.add_argument("--runs", type=int, default=3, help="runs, each the best of three alternated passes")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    size = int(args.mib * 2**20)
    data = b"".join(b"MSG r.x 7 %d\r\n" % size + bytes(size) + b"\r\n" for _ in range(args.messages))
    step = args.read_kib * 1024
    reads = [data[i : i + step] for i in range(0, len(data), step)]
    total = size * args.messages
    runs = []
    for _ in range(args.runs):
        best = {}
        for _ in range(3):  # alternated, best of three each
            for name, cls in (("nats-py", NatsParser), ("gathered", receive.Parser)):
                best[name] = min(best.get(name, float("inf")), await seconds(cls, reads, total))
        runs.append({name: 1e9 * s / total for name, s in best.items()})
        print("  ".join(f"{name} {ns:.3f} ns a byte" for name, ns in runs[-1].items()) +
              f"  nats-py / gathered {runs[-1]['nats-py'] / runs[-1]['gathered']:.1f}x", flush=True)
    doc = {"benchmark": "receive_parse", "machine": {"python": platform.python_version()},
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "message_bytes": size, "messages": args.messages,
           "read_bytes": step, "ns_per_byte": runs,
           "range": {name: [min(r[name] for r in runs), max(r[name] for r in runs)] for name in runs[0]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
