"""Compression benchmark: what each compressor saves on the wire and what it costs in loss and time.

In one run, side by side against the uncompressed path:
- DiLoCo in one process on a preset (N workers on their own shards, H inner AdamW steps, the outer Nesterov
  step): the uplink bytes per round as the codec would send them, and the validation loss after R rounds;
- compress and decompress throughput on one large fp32 tensor, against a raw copy of the same bytes
  (torch clone, and bytes(bytearray) of its buffer).
Writes benchmarks/results/compression.json.

    nice -n 10 .venv/bin/python benchmarks/compression.py [--preset small] [--rounds 100] [--workers 2]
        [--inner-steps 2] [--numel 4194304] [--specs none int8 topkq:0.01 ...]

The outer optimizer is the job's default (cleave.train.job.DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from pathlib import Path

import torch

from cleave.compression import ErrorFeedback, get_compressor, raw_bytes, unpack, wire_bytes
from cleave.methods import common, diloco
from cleave.models import build_model, get_preset
from cleave.train.data import Corpus
from cleave.train.job import JobConfig

RESULTS = Path(__file__).parent / "results" / "compression.json"
DEFAULT_SPECS = ("none", "fp16", "bf16", "int8", "topk:0.1", "topk:0.01", "topkq:0.01", "topkq:0.02")
VAL_BATCHES = 8
REPEATS = 5


def val_loss(model: torch.nn.Module, corpus: Corpus, job: JobConfig) -> float:
    model.eval()
    with torch.no_grad():
        losses = [
            common.lm_loss(
                model, *corpus.batch(job.seed, 1_000_000 + i, job.batch_size, job.seq, "val")
            ).item()
            for i in range(VAL_BATCHES)
        ]
    return statistics.fmean(losses)


def run_diloco(
    spec: str, job: JobConfig, corpus: Corpus, workers: int, inner: int, rounds: int,
    outer: diloco.DilocoConfig | None = None,
) -> dict:
    """DiLoCo with every pseudo-gradient compressed by `spec` (with error feedback); bytes and loss.
    `outer` sets the outer optimizer (default: the job's outer_lr and outer_momentum)."""
    cfg = get_preset(job.preset)
    global_model = build_model(cfg, seed=job.seed)
    outer = outer or diloco.DilocoConfig(inner_steps=inner, outer_lr=job.outer_lr, outer_momentum=job.outer_momentum)
    server = diloco.DilocoServer(common.trainable(global_model), outer)
    fleet = []
    for _ in range(workers):
        model = build_model(cfg, seed=job.seed)
        fleet.append((model, common.make_adamw(model.parameters(), job), ErrorFeedback(get_compressor(spec))))
    up_bytes, raw, t0 = 0, 0, time.perf_counter()
    for r in range(rounds):
        state = server.global_state()
        for w, (model, opt, ef) in enumerate(fleet):
            batches = (common.shard_batch(corpus, job, w, r * inner + h) for h in range(inner))
            delta, _ = diloco.worker_round(model, opt, state, batches, inner, job.grad_clip)
            msg = ef.pack(delta)
            up_bytes += wire_bytes(msg)
            raw += sum(raw_bytes(t) for t in delta.values())
            server.submit(f"w{w}", r, unpack(msg), inner * job.batch_size * job.seq)
        server.close_round()
    return {
        "spec": spec,
        "bytes_per_round": up_bytes / rounds,
        "raw_bytes_per_round": raw / rounds,
        "val_loss": val_loss(global_model, corpus, job),
        "seconds": time.perf_counter() - t0,
    }


def best_of(fn, repeats: int = REPEATS) -> float:  # noqa: ANN001
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def throughput(spec: str, t: torch.Tensor) -> dict:
    comp = get_compressor(spec)
    packed = comp.compress(t)
    mb = raw_bytes(t) / 1e6
    return {
        "spec": spec,
        "compress_mb_s": mb / best_of(lambda: comp.compress(t)),
        "decompress_mb_s": mb / best_of(lambda: comp.decompress(packed)),
        "payload_bytes": packed.payload_bytes,
        "raw_bytes": raw_bytes(t),
    }


def raw_copy(t: torch.Tensor) -> dict:
    """Copies of the same bytes with no compression: the ceiling a compressor is measured against."""
    mb = raw_bytes(t) / 1e6
    arr = t.numpy()
    return {
        "clone_mb_s": mb / best_of(lambda: t.clone()),
        "tobytes_mb_s": mb / best_of(lambda: arr.tobytes()),  # what the codec does for an uncompressed tensor
        "bytes_bytearray_mb_s": mb / best_of(lambda: bytes(bytearray(arr.data))),  # two copies
    }


def table(runs: list[dict], speeds: list[dict], copy: dict) -> str:
    base = next(r for r in runs if r["spec"] == "none")
    by_spec = {s["spec"]: s for s in speeds}
    rows = [
        f"{'compressor':<11} {'KB/round':>9} {'x smaller':>9} {'val loss':>9} {'vs none':>8} "
        f"{'compress MB/s':>13} {'decompress MB/s':>15} {'vs tobytes':>10}"
    ]
    for r in runs:
        s = by_spec[r["spec"]]
        rows.append(
            f"{r['spec']:<11} {r['bytes_per_round'] / 1e3:>9.1f} {base['bytes_per_round'] / r['bytes_per_round']:>9.2f} "
            f"{r['val_loss']:>9.4f} {r['val_loss'] - base['val_loss']:>+8.4f} "
            f"{s['compress_mb_s']:>13.0f} {s['decompress_mb_s']:>15.0f} {s['compress_vs_copy']:>10.2f}"
        )
    rows.append(
        f"raw copy of the same tensor: torch clone {copy['clone_mb_s']:.0f} MB/s, numpy tobytes "
        f"{copy['tobytes_mb_s']:.0f} MB/s, bytes(bytearray) {copy['bytes_bytearray_mb_s']:.0f} MB/s"
    )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--inner-steps", type=int, default=2)
    ap.add_argument("--numel", type=int, default=1 << 22, help="elements of the throughput tensor (fp32)")
    ap.add_argument("--specs", nargs="+", default=list(DEFAULT_SPECS))
    ap.add_argument("--jobs", type=int, default=1, help="DiLoCo runs in parallel processes (one per spec at most)")
    args = ap.parse_args()
    if "none" not in args.specs:
        args.specs.insert(0, "none")
    job, corpus = JobConfig(preset=args.preset), Corpus()
    with multiprocessing.get_context("spawn").Pool(args.jobs, initializer=torch.set_num_threads,
                                                   initargs=(max(1, torch.get_num_threads() // args.jobs),)) as pool:
        pending = [pool.apply_async(run_diloco, (s, job, corpus, args.workers, args.inner_steps, args.rounds))
                   for s in args.specs]
        runs = []
        for p in pending:  # the same seed and batches in every process: bytes and losses do not depend on it
            runs.append(p.get())
            print(f"{runs[-1]['spec']}: {runs[-1]['bytes_per_round'] / 1e3:.1f} KB/round, val loss "
                  f"{runs[-1]['val_loss']:.4f} ({runs[-1]['seconds']:.0f}s)", flush=True)
    t = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    speeds, copy = [throughput(s, t) for s in args.specs], raw_copy(t)
    for s in speeds:
        s["compress_vs_copy"] = s["compress_mb_s"] / copy["tobytes_mb_s"]
        s["decompress_vs_copy"] = s["decompress_mb_s"] / copy["tobytes_mb_s"]
    print(
        f"DiLoCo on {args.preset}: {args.workers} workers, H={args.inner_steps}, {args.rounds} rounds; "
        f"throughput on {args.numel} fp32 values ({raw_bytes(t) / 1e6:.0f} MB), {torch.get_num_threads()} threads"
    )
    print(table(runs, speeds, copy))
    result = {
        "preset": args.preset,
        "workers": args.workers,
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "numel": args.numel,
        "threads": torch.get_num_threads(),
        "jobs": args.jobs,
        "diloco": runs,
        "throughput": speeds,
        "raw_copy": copy,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
