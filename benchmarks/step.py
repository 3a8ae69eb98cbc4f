"""Step benchmark: the fleet's step against the reference and against its floor on this machine.

For each preset, in one run: the reference step (one process, plain PyTorch), the distributed step (a local
nats-server, the scheduler, the PS and N worker processes), the bytes on the wire against the bytes the
tile plan implies, and the floor max(wire bytes / NATS throughput, GEMM FLOPs / GEMM rate), both rates
measured here in the same run. Writes benchmarks/results/step.json.

    .venv/bin/python benchmarks/step.py [--presets tiny small] [--steps 12] [--workers 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from cleave import bus as busmod
from cleave.job import JobConfig
from cleave.models import gemm_shapes, get_preset
from cleave.training import Trainer
from cleave_cli.jobrun import LocalFleet
from cleave_ps.dispatcher import DEFAULT_BLOCK, block_shape

WARMUP_STEPS = 2
DEFAULT_WINDOW = 32  # messages in flight while measuring NATS throughput
RESULTS = Path(__file__).parent / "results" / "step.json"


def reference_step_s(job: JobConfig, steps: int) -> float:
    trainer = Trainer(job)
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        trainer.step(s)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP_STEPS:])


def gemm_rate(job: JobConfig) -> tuple[float, float]:
    """(FLOPs of one step's GEMMs, the rate this machine computes them at in one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker computes
    flops, seconds = 0, 0.0
    for g in gemm_shapes(get_preset(job.preset), job.batch_size, job.seq):
        a, bt = torch.randn(g.m, g.k), torch.randn(g.n, g.k)
        a @ bt.T
        t0 = time.perf_counter()
        for _ in range(g.count_per_step):
            a @ bt.T
        seconds += time.perf_counter() - t0
        flops += g.flops * g.count_per_step
    torch.set_num_threads(threads)
    return flops, flops / seconds


def plan_bytes(job: JobConfig, workers: int) -> int:
    """Bytes a step's tiles imply: inputs (rows + cols)·k·4 down and the rows·cols·4 block up, per tile."""
    total = 0
    for g in gemm_shapes(get_preset(job.preset), job.batch_size, job.seq):
        rows, cols = block_shape(g.m, g.n, None, workers)
        for r0 in range(0, g.m, rows):
            for c0 in range(0, g.n, cols):
                r, c = min(rows, g.m - r0), min(cols, g.n - c0)
                total += g.count_per_step * 4 * ((r + c) * g.k + r * c)
    return total


SUBSCRIBER = """
import asyncio, sys, nats
async def main(url, count):
    nc = await nats.connect(url)
    got, done = 0, asyncio.Event()
    async def on_msg(msg):
        nonlocal got
        got += 1
        if got % 8 == 0 or got == count:
            await nc.publish("bench.ack", str(got).encode())
        if got == count:
            done.set()
    await nc.subscribe("bench.tput", cb=on_msg, pending_bytes_limit=1 << 30, pending_msgs_limit=100_000)
    await nc.publish("bench.ready", b"")
    await nc.flush()
    await asyncio.wait_for(done.wait(), 120)
    await nc.publish("bench.done", b"")
    await nc.flush()
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def nats_throughput(url: str, size: int = 1 << 20, count: int = 300) -> float:
    """Bytes/s from this process through nats-server to a subscriber in another process (1 MiB messages)."""
    pub = await busmod.connect(url, "bench-pub")
    ready, done = await pub.nc.subscribe("bench.ready"), await pub.nc.subscribe("bench.done")
    acked, moved = 0, asyncio.Event()

    async def on_ack(msg) -> None:
        nonlocal acked
        acked = int(msg.data)
        moved.set()

    await pub.nc.subscribe("bench.ack", cb=on_ack)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", SUBSCRIBER, url, str(count))
    await ready.next_msg(timeout=30)
    payload = bytes(size)
    t0 = time.perf_counter()
    for i in range(count):
        while i - acked >= DEFAULT_WINDOW:  # flow control, as the PS's per-worker window of tiles
            moved.clear()
            await asyncio.wait_for(moved.wait(), 30)
        await pub.nc.publish("bench.tput", payload)
    await done.next_msg(timeout=120)
    rate = size * count / (time.perf_counter() - t0)
    await proc.wait()
    await pub.close()
    return rate


def distributed(job: JobConfig, workers: int, run_dir: Path) -> tuple[list[dict], float]:
    # uniform tiles, so that the bytes the tile plan implies are known exactly (block_shape below)
    fleet = LocalFleet(run_dir, workers, scheduler_env={
        "CLEAVE_SCHEDULER_PLANNER": "uniform",
        "CLEAVE_SCHEDULER_TILE_ROWS": str(DEFAULT_BLOCK), "CLEAVE_SCHEDULER_TILE_COLS": str(DEFAULT_BLOCK),
    })
    try:
        fleet.start()
        tput = asyncio.run(nats_throughput(fleet.stack.nats_url))
        fleet.start_ps(job, run_dir / "metrics.jsonl")
        lines = fleet.wait_ps(run_dir / "metrics.jsonl", timeout_s=600)
    finally:
        fleet.stop()
    return lines, tput


def bench(preset: str, steps: int, workers: int) -> dict:
    job = JobConfig(job_id=f"bench-{preset}", preset=preset, steps=steps)
    ref_s = reference_step_s(job, steps)
    flops, rate = gemm_rate(job)
    with tempfile.TemporaryDirectory() as tmp:
        lines, tput = distributed(job, workers, Path(tmp))
    body = lines[WARMUP_STEPS:]
    step_s = statistics.median(m["step_time_s"] for m in body)
    wire = statistics.median(m["bytes_down"] + m["bytes_up"] for m in body)
    floor = max(wire / tput, flops / rate)
    return {
        "preset": preset, "workers": workers, "steps": steps,
        "reference_step_s": ref_s, "distributed_step_s": step_s, "distributed_over_reference": step_s / ref_s,
        "wire_bytes_per_step": wire, "plan_bytes_per_step": plan_bytes(job, workers),
        "wire_over_plan": wire / plan_bytes(job, workers), "nats_bytes_per_s": tput, "gemm_flops_per_step": flops,
        "gemm_flops_per_s": rate, "floor_s": floor, "step_over_floor": step_s / floor,
        "tiles_per_step": statistics.median(m["tiles"] for m in body),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--workers", type=int, default=4)
    args = p.parse_args()
    results = [bench(preset, args.steps, args.workers) for preset in args.presets]
    for r in results:
        print(f"{r['preset']:>6}: step {r['distributed_step_s']:.3f}s vs reference {r['reference_step_s']:.3f}s "
              f"(x{r['distributed_over_reference']:.1f}); wire/plan bytes {r['wire_over_plan']:.3f}; "
              f"floor {r['floor_s']:.3f}s (NATS {r['nats_bytes_per_s'] / 1e6:.0f} MB/s, GEMM "
              f"{r['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s) -> step/floor {r['step_over_floor']:.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
