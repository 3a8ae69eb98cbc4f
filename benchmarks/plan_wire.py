"""Plan wire benchmark: a 10,000-device plan, packed (what the scheduler sends) against the old list form.

The plan is the scheduler's (its registry filled with synthetic devices, `with_layouts`, the cost planner)
for gpt2-medium (batch 8, seq 1024, fp32) and OPT-13B at the simulator's defaults (batch 128, seq 1024, fp16).
Measured side by side in one run: encoded bytes (the codec's frame, zstd where it pays) of both forms, and
the decode time of the packed one (best and median of 5; the list form is refused by the codec's entry
limit). Writes benchmarks/results/plan_wire.json.

    nice -n 10 .venv/bin/python benchmarks/plan_wire.py [--devices 10000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import msgpack
import zstandard

from cleave import codec
from cleave.errors import WireError
from cleave.schemas import MAX_PLAN_BYTES, Plan
from cleave_scheduler.synthetic import job_shapes, scheduler_plan, synthetic_registry

RESULTS = Path(__file__).parent / "results" / "plan_wire.json"
JOBS = (("gpt2-medium", 8, 1024, 4), ("opt-13b", 128, 1024, 2))


def list_form(plan: Plan) -> bytes:
    """The frame the old schema produced: workers and layouts as msgpack lists of maps and ints."""
    doc = {**plan.model_dump(), "workers": [w.model_dump() for w in plan.workers],
           "gemms": [{**g.model_dump(), "boxes": list(g.boxes), "owners": list(g.owners)} for g in plan.gemms]}
    body = msgpack.packb(doc, use_bin_type=True)
    return codec.MAGIC + bytes([codec.VERSION, codec.FLAG_ZSTD]) + zstandard.ZstdCompressor(level=1).compress(body)


def measure(model: str, batch: int, seq: int, b: int, devices: int) -> dict:
    t0 = time.perf_counter()
    plan = scheduler_plan(synthetic_registry(devices), job_shapes(model, batch, seq, b))
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    packed = codec.encode(plan)
    encode_s = time.perf_counter() - t0
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        back = codec.decode(packed, Plan, MAX_PLAN_BYTES)
        times.append(time.perf_counter() - t0)
    assert back == plan
    old = list_form(plan)
    try:
        codec.decode(old, Plan, MAX_PLAN_BYTES)
        old_decodes = "yes"
    except WireError as e:
        old_decodes = f"refused ({e.reason})"
    return {"model": model, "batch": batch, "seq": seq, "dtype_bytes": b, "devices": devices,
            "boxes": sum(len(g.owners) for g in plan.gemms), "packed_bytes": len(packed), "list_bytes": len(old),
            "list_over_packed": len(old) / len(packed), "encode_s": encode_s, "decode_best_s": min(times),
            "decode_median_s": statistics.median(times), "list_form_decodes": old_decodes, "plan_s": plan_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=10_000)
    args = p.parse_args()
    rows = [measure(*job, args.devices) for job in JOBS]
    for r in rows:
        print(f"{r['model']} b{r['batch']} on {r['devices']} devices, {r['boxes']} boxes: packed {r['packed_bytes']:,} B "
              f"(list form {r['list_bytes']:,} B, x{r['list_over_packed']:.2f}, {r['list_form_decodes']}); "
              f"decode {r['decode_best_s'] * 1e3:.1f} ms best, {r['decode_median_s'] * 1e3:.1f} ms median; "
              f"encode {r['encode_s'] * 1e3:.0f} ms")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
