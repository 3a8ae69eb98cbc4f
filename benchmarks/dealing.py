"""The dealing core's cost per event as the fleet grows, side by side in one run (no bus: `cleave.gemm.dealer` alone).

For 10 to 10,000 workers: one GEMM with 16 tiles a worker dealt to the end, every result followed by a PS
tick (deadlines, offers, speculation), as at a GEMM's tail when most workers wait idle; then 10% of the
workers lost at once mid-GEMM (a plan without them). Prints microseconds of CPU per event and the ratio to
the smallest fleet. Writes benchmarks/results/dealing.json.

    .venv/bin/python -m benchmarks.dealing [--workers 10,100,1000,10000]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from pathlib import Path

from cleave.gemm import tiles
from cleave.gemm.dealer import Dealer, Policy, Send, Work
from cleave.schemas import DeviceProfile

RESULTS = Path(__file__).parent / "results" / "dealing.json"
PROFILE = DeviceProfile(flops=1e10, memory_bytes=1 << 30, downlink_bytes_per_s=1e7, uplink_bytes_per_s=5e6,
                        latency_s=0.01)


def one(n: int) -> dict:
    dealer = Dealer(Policy(window=2))
    fleet = [(f"w{i}", 1 << 27, PROFILE) for i in range(n)]
    dealer.set_fleet(fleet, 0.0)
    grid = tiles.grid(64 * 4, 64 * 4 * n, 64, 64)  # 16 tiles a worker
    owners = [f"w{i % n}" for i in range(len(grid))]
    work = Work(1, 256, 256 * n, 64, 4, grid, owners, 4)
    start = time.process_time()
    queue = deque(dealer.begin(work, 0.0))
    begin_s = time.process_time() - start
    events, now, lost = 0, 0.0, False
    start = time.process_time()
    while queue:
        s = queue.popleft()
        if not isinstance(s, Send):  # a loss or a link to prove: nothing for this loop to answer
            continue
        now += 1e-5
        if not lost and events == len(grid) // 2:  # a tenth of the fleet leaves at once
            queue.extend(dealer.set_fleet(fleet[n // 10 :], now))
            lost = True
        if s.worker in dealer.members:
            _, more = dealer.done(s.worker, s.tile.index, s.attempt, now)
            queue.extend(more)
        queue.extend(dealer.tick(now))
        events += 1
    per_event = (time.process_time() - start) / events
    assert dealer.complete
    return {"workers": n, "tiles": len(grid), "events": events, "begin_s": begin_s, "us_per_event": per_event * 1e6,
            "resent": dealer.deal().ledger.resent}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="10,100,1000,10000")
    args = ap.parse_args()
    rows = [one(int(n)) for n in args.workers.split(",")]
    for r in rows:
        r["vs_smallest"] = r["us_per_event"] / rows[0]["us_per_event"]
        print(f"{r['workers']:6d} workers: {r['us_per_event']:6.1f} us CPU per result+tick "
              f"({r['vs_smallest']:.2f}x the smallest fleet), {r['tiles']} tiles, {r['resent']} re-sent after "
              f"10% left, first deal {r['begin_s']:.3f} s")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
