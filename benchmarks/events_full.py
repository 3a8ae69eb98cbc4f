"""How long `cleave status`, `cleave follow` and `cleave forget` take on a hub whose events stream is full: the
step lines of `--jobs` jobs (`--lines` in all, the events stream holds at most 256 MiB of them: ~480,000 lines of
~490 bytes) in a real nats-server's JetStream, filed as a PS files them (`Bus.emit`'s subject); then one job's
step lines read (`cleave status --metrics-out`: `cleave.api.hub.read_metrics`; `cleave follow` reads them once,
then at each poll what came since: `read_new_metrics`), every job's last line and count (`cleave status`:
`read_lasts`), and the runner's forget of one job (`cleave_cli.forget.forget`: its events are purged by subject).
The runner's loop waits for a forget, so that is how long its other jobs' PSs go unwatched.

    .venv/bin/python benchmarks/events_full.py [--lines 480000] [--jobs 100] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from cleave import bus as busmod
from cleave import codec
from cleave.api.hub import read_lasts, read_metrics, read_new_metrics
from cleave.api.stack import Stack
from cleave.schemas import EVENTS_STREAM, JOBS_BUCKET, StepMetrics, event_subject
from cleave_cli.forget import forget

BATCH = 1000  # publishes in flight at once
T = TypeVar("T")


async def measure(url: str, lines: int, jobs: int, run_dir: Path) -> dict:
    bus = await busmod.connect(url, "forget-scan")
    await bus.setup()
    t0 = time.perf_counter()
    for start in range(0, lines, BATCH):
        lines_ = [StepMetrics(job=f"job-{i % jobs}", step=i, loss=2.0, step_time_s=0.5, workers=4)
                  for i in range(start, min(start + BATCH, lines))]
        await asyncio.gather(*(bus.js.publish(event_subject(m), codec.encode(m)) for m in lines_))
    filled_s = time.perf_counter() - t0
    info = await bus.js.stream_info(EVENTS_STREAM)
    one_s, one = await timed(read_metrics(bus, "job-7"))
    _, (_, past) = await timed(read_new_metrics(bus, "job-7"))
    poll_s, (polled, _) = await timed(read_new_metrics(bus, "job-7", past))  # `follow` once it has read them
    all_s, every = await timed(read_lasts(bus))
    with_records = await bus.kv(JOBS_BUCKET)  # (forget ends by purging the record: one must be there)
    await with_records.put("job-7", b"x")
    forget_s, gone = await timed(forget(bus, "job-7", run_dir / "job-7", run_dir / "ps-job-7.log"))
    left = await bus.js.stream_info(EVENTS_STREAM)
    await bus.close()
    return {"lines": info.state.messages, "stream_bytes": info.state.bytes, "jobs": jobs, "fill_s": round(filled_s, 2),
            "one_job_s": round(one_s, 3), "one_job_lines": len(one),
            "follow_poll_s": round(poll_s, 3), "follow_poll_lines": len(polled), "all_jobs_s": round(all_s, 3),
            "all_jobs_lines": sum(n for _, n in every.values()), "forget_s": round(forget_s, 3),
            "events_deleted": gone.events, "lines_left": left.state.messages}


async def timed(work: Awaitable[T]) -> tuple[float, T]:
    t0 = time.perf_counter()
    got = await work
    return time.perf_counter() - t0, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=480_000)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "events_full.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        stack = Stack(Path(d))
        try:
            result = asyncio.run(measure(stack.start_nats(), args.lines, args.jobs, Path(d)))
        finally:
            stack.stop_all()
    print(f"{result['lines']:,} step lines ({result['stream_bytes'] / 2**20:.0f} MiB) of {result['jobs']} jobs: one "
          f"job's {result['one_job_lines']:,} read in {result['one_job_s']} s (a follow's later poll "
          f"{result['follow_poll_s']} s), every job's last and count "
          f"({result['all_jobs_lines']:,}) in {result['all_jobs_s']} s; "
          f"one job forgotten in {result['forget_s']} s ({result['events_deleted']:,} events deleted, "
          f"{result['lines_left']:,} left)")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
