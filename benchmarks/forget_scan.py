"""How long forgetting a job takes on a hub whose events stream is full: the step lines of `--jobs` jobs
(`--lines` in all, the events stream holds at most 256 MiB of them: ~480,000 lines of ~490 bytes) in a real
nats-server's JetStream, then the runner's forget of one job (`cleave_cli.forget.forget`: its events found in one
pass over the stream, then deleted). The runner's loop waits for a forget, so this is how long its other jobs'
PSs go unwatched.

    .venv/bin/python benchmarks/forget_scan.py [--lines 480000] [--jobs 100] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from cleave import bus as busmod
from cleave import codec
from cleave.api.hub import job_events
from cleave.api.stack import Stack
from cleave.schemas import EVENTS_STREAM, JOBS_BUCKET, SUBJECT_EVENTS, StepMetrics
from cleave_cli.forget import forget

BATCH = 1000  # publishes in flight at once


async def measure(url: str, lines: int, jobs: int, run_dir: Path) -> dict:
    bus = await busmod.connect(url, "forget-scan")
    await bus.setup()
    subject = SUBJECT_EVENTS.format(kind="metrics")
    t0 = time.perf_counter()
    for start in range(0, lines, BATCH):
        await asyncio.gather(*(bus.js.publish(subject, codec.encode(StepMetrics(
            job=f"job-{i % jobs}", step=i, loss=2.0, step_time_s=0.5, workers=4))) for i in range(start, start + BATCH)))
    filled_s = time.perf_counter() - t0
    info = await bus.js.stream_info(EVENTS_STREAM)
    t0 = time.perf_counter()
    found = await job_events(bus, "job-7")
    scan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with_records = await bus.kv(JOBS_BUCKET)  # (forget ends by purging the record: one must be there)
    await with_records.put("job-7", b"x")
    gone = await forget(bus, "job-7", run_dir / "job-7", run_dir / "ps-job-7.log")
    forget_s = time.perf_counter() - t0
    await bus.close()
    return {"lines": info.state.messages, "stream_bytes": info.state.bytes, "jobs": jobs, "fill_s": round(filled_s, 2),
            "job_events_s": round(scan_s, 2), "found": len(found), "forget_s": round(forget_s, 2),
            "events_deleted": gone.events}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=480_000)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "forget_scan.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        stack = Stack(Path(d))
        try:
            result = asyncio.run(measure(stack.start_nats(), args.lines, args.jobs, Path(d)))
        finally:
            stack.stop_all()
    print(f"{result['lines']:,} step lines ({result['stream_bytes'] / 2**20:.0f} MiB) of {result['jobs']} jobs: one "
          f"pass finds one job's {result['found']:,} in {result['job_events_s']} s; its whole forget "
          f"(deleting them too) {result['forget_s']} s")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
