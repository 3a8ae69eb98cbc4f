"""Streamed checkpoints: what a commit and a restore cost the PS in memory and time, against the state's size.

One run against a real nats-server (a temporary store): a model of --gib GiB of fp32 parameters with its
AdamW state, committed once through `cleave_ps.state.persist.Persister` and loaded back into a fresh model.
Prints the peak RSS each adds over the resident state (VmHWM, reset before each), as a ratio of the
checkpoint's size, and the seconds. Writes benchmarks/results/checkpoint.json.

    nice -n 10 .venv/bin/python benchmarks/checkpoint.py [--gib 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cleave import bus as busmod  # noqa: E402
from cleave.runtime.memory import resident  # noqa: E402
from cleave_ps.state.persist import Persister, snapshot  # noqa: E402
from tests.conftest import NatsServer  # noqa: E402 - the tests' real nats-server on a free port

RESULTS = Path(__file__).parent / "results" / "checkpoint.json"
SIDE = 8192  # each parameter is SIDE x SIDE fp32 = 256 MiB


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def model_and_adamw(n: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    m = nn.ParameterList([nn.Parameter(torch.randn(SIDE, SIDE)) for _ in range(n)])
    opt = torch.optim.AdamW(m.parameters(), foreach=False)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW's two moments exist, as after a training step
    for p in m.parameters():
        p.grad = None
    return m, opt


async def measure(url: str, n: int) -> dict:
    bus = await busmod.connect(url, "bench")
    await bus.setup()
    try:
        m, opt = model_and_adamw(n)
        writer = Persister(bus, "bench", "{}")
        await writer.open()
        await writer.claim_epoch()
        reset_peak()
        before, t0 = resident()[1], time.perf_counter()
        head = await writer.commit(snapshot(m, opt, "bench", 0, writer.epoch), ())
        commit_s, commit_extra = time.perf_counter() - t0, (resident()[0] - before) / 1e9
        m2 = nn.ParameterList([nn.Parameter(torch.zeros(SIDE, SIDE)) for _ in range(n)])  # resident, as a built model
        opt2 = torch.optim.AdamW(m2.parameters(), foreach=False)
        reader = Persister(bus, "bench", "{}")
        await reader.open()
        reset_peak()
        before, t0 = resident()[1], time.perf_counter()
        await reader.load(m2, opt2)
        load_s, load_extra = time.perf_counter() - t0, (resident()[0] - before) / 1e9
        exact = all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    finally:
        await bus.close()
    size = head.size / 1e9
    return {"checkpoint_gb": round(size, 3), "commit_s": round(commit_s, 1), "commit_extra_rss_gb": round(commit_extra, 3),
            "commit_extra_over_size": round(commit_extra / size, 4), "commit_gb_per_s": round(size / commit_s, 3),
            "load_s": round(load_s, 1), "load_extra_rss_gb": round(load_extra, 3),
            "load_extra_over_size": round(load_extra / size, 3), "optimizer_gb": round(2 * size / 3, 3), "exact": exact}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="fp32 parameters, GiB (the checkpoint is 3x)")
    args = p.parse_args()
    n = max(1, round(args.gib * 4))
    with tempfile.TemporaryDirectory() as d:
        server = NatsServer(Path(d) / "jetstream", Path(d) / "nats.log")
        server.start()
        try:
            row = asyncio.run(measure(server.url, n))
        finally:
            server.stop()
    print(json.dumps(row))
    print(f"commit adds {row['commit_extra_over_size']:.2%} of the checkpoint's size to the PS's peak; "
          f"restore adds {row['load_extra_over_size']:.2f}x (the fresh optimizer tensors are 0.67x)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
