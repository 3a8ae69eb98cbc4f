"""The mission's models through Cleave on one GPU, beside `--reference` on the same GPU.

For each model: `cleave train --reference` (one process, plain PyTorch, on the device the job names), then the
same job through a local stack whose PS computes on that device and whose WORKERS workers all share it (each
worker computes on CUDA when torch sees it). Prints and records, side by side from the one run: the losses and
their largest difference, median step times (the first step, which warms up cuBLAS, left out when there are
more) and their ratio, and each process's peak memory: `torch.cuda.max_memory_allocated` of the PS, the
reference and every worker, and their peak RSS (benchmarks/memhook records them as each process exits).
Writes benchmarks/results/gpu.json (or --out) after each model, so that nothing measured is lost.

On a GPU machine (benchmarks/gpu_check.sh sets it up; sized to finish within 8 minutes on one H200, which
it has not yet run on):

    python benchmarks/gpu.py                       # gpt2-medium and llama3-1b, seq 512, batch 4, 3 steps

Here, and in the test suite, the same code on the CPU with a tiny preset (seconds):

    .venv/bin/python benchmarks/gpu.py --models tiny --steps 2 --out /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cleave.api.fleet import LocalFleet
from cleave.errors import CleaveError
from cleave.train.job import JobConfig

RESULTS = Path(__file__).parent / "results" / "gpu.json"
HOOK = Path(__file__).parent / "memhook"
WORKERS = 4
SHAPES = {  # (batch, seq) per model: what the mission asks, on one H200; the tiny presets for the CPU test
    "gpt2-medium": (4, 512), "llama3-1b": (4, 512), "tiny": (2, 32), "tiny-llama": (2, 32),
}
DEFAULT_BUDGET_S = 450  # the whole run, both models; a model that would start with less than MIN_LEFT_S is skipped
MIN_LEFT_S = 60
LOGS_KEPT = ("ps.log", "worker-1.log")  # their tails go into the row of a run that stopped
GB = 1e9


def memory_env(folder: Path) -> dict[str, str]:
    """The environment under which a started Python process records its peak memory into `folder`."""
    path = os.pathsep.join(p for p in (str(HOOK), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "CLEAVE_BENCH_MEMORY_DIR": str(folder)}


def memory_records(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def reference(job_file: Path, tmp: Path, timeout_s: float) -> tuple[list[dict], dict]:
    """`cleave train --reference`: its metrics lines and its memory record."""
    folder, out = tmp / "mem-ref", tmp / "ref.jsonl"
    folder.mkdir()
    subprocess.run([sys.executable, "-m", "cleave_cli", "train", "--config", str(job_file), "--reference",
                    "--metrics-out", str(out), "--run-dir", str(tmp / "ref")], check=True, capture_output=True,
                   env={**os.environ, **memory_env(folder)}, timeout=timeout_s)
    records = memory_records(folder)
    return [json.loads(line) for line in out.read_text().splitlines()], records[0] if records else {}


def distributed(job: JobConfig, tmp: Path, workers: int, timeout_s: float) -> dict:
    """The job through a local stack: its metrics lines, the memory records of the PS and the workers."""
    folder, out = tmp / "mem-dist", tmp / "dist.jsonl"
    folder.mkdir()
    env = memory_env(folder)
    fleet = LocalFleet(tmp / "dist", workers, worker_env=env)
    lines, stopped = [], None
    try:
        fleet.start()
        fleet.start_ps(job, out, ps_env=env)
        lines = fleet.wait_ps(out, timeout_s=timeout_s)
    except CleaveError as e:
        stopped = str(e)
        lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    finally:
        fleet.stop()  # SIGTERM: the workers exit gracefully and record their peaks
    if stopped:  # the run dir goes with the temporary folder: keep what the logs said last
        stopped += "".join(f"\n--- {p.name}:\n{p.read_text(errors='replace')[-1500:]}"
                           for p in sorted((tmp / "dist" / "logs").glob("*.log")) if p.name in LOGS_KEPT)
    records = memory_records(folder)
    return {"lines": lines, "stopped": stopped,
            "ps": next((r for r in records if r["argv"][:1] == ["ps"]), {}),
            "workers": [r for r in records if r["argv"][:1] == ["worker"]]}


def median_step(lines: list[dict]) -> float:
    times = [m["step_time_s"] for m in lines]
    return statistics.median(times[1:] if len(times) > 1 else times)


def gb(record: dict, key: str) -> float | None:
    return round(record[key] / GB, 3) if key in record else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def memory_row(ref: dict, dist: dict) -> dict:
    ps, workers = dist["ps"], dist["workers"]
    row = {
        "ps_cuda_max_allocated_gb": gb(ps, "cuda_max_allocated_bytes"),
        "reference_cuda_max_allocated_gb": gb(ref, "cuda_max_allocated_bytes"),
        "ps_peak_rss_gb": gb(ps, "rss_peak_bytes"), "reference_peak_rss_gb": gb(ref, "rss_peak_bytes"),
        "workers_cuda_max_allocated_gb": [gb(w, "cuda_max_allocated_bytes") for w in workers],
        "workers_cuda_max_reserved_gb": [gb(w, "cuda_max_reserved_bytes") for w in workers],
        "workers_peak_rss_gb": [gb(w, "rss_peak_bytes") for w in workers],
        "devices": {"ps": ps.get("device", "cpu"), "reference": ref.get("device", "cpu"),
                    "workers": sorted({w.get("device", "cpu") for w in workers})},
    }
    row["cuda_ratio"] = ratio(row["ps_cuda_max_allocated_gb"], row["reference_cuda_max_allocated_gb"])
    row["rss_ratio"] = ratio(row["ps_peak_rss_gb"], row["reference_peak_rss_gb"])
    return row


def compare(ref_lines: list[dict], lines: list[dict]) -> dict:
    """Losses side by side, their largest difference, step times and their ratio."""
    pairs = list(zip(lines, ref_lines, strict=False))
    ref_step = median_step(ref_lines)
    row = {"reference_losses": [m["loss"] for m in ref_lines], "losses": [m["loss"] for m in lines],
           "reference_step_s": [round(m["step_time_s"], 3) for m in ref_lines],
           "reference_median_step_s": round(ref_step, 3)}
    if pairs:
        step = median_step(lines)
        row.update(
            losses_equal=all(m["loss"] == r["loss"] for m, r in pairs) and len(lines) == len(ref_lines),
            max_abs_loss_diff=max(abs(m["loss"] - r["loss"]) for m, r in pairs),
            max_rel_loss_diff=max(abs(m["loss"] - r["loss"]) / abs(r["loss"]) for m, r in pairs),
            step_s=[round(m["step_time_s"], 3) for m in lines], median_step_s=round(step, 3),
            step_ratio=round(step / ref_step, 2), gemm_s=[round(m.get("gemm_s", 0.0), 3) for m in lines],
            checkpoint_s=[round(m.get("checkpoint_s", 0.0), 2) for m in lines],
            bytes_down_per_step=[m["bytes_down"] for m in lines], tiles_resent=sum(m["tiles_resent"] for m in lines))
    return row


def one(name: str, steps: int, workers: int, device: str, shape: tuple[int, int], timeout_s: float) -> dict:
    batch, seq = shape
    job = JobConfig(job_id=f"gpu-{name}", preset=name, steps=steps, batch_size=batch, seq_len=seq, device=device)
    row = {"model": name, "batch_size": batch, "seq_len": job.seq, "steps": steps, "workers": workers,
           "device": device}
    with tempfile.TemporaryDirectory(prefix="cleave-gpu-") as d:
        tmp = Path(d)
        (tmp / "job.json").write_text(job.model_dump_json())
        t0 = time.monotonic()
        ref_lines, ref_mem = reference(tmp / "job.json", tmp, timeout_s)
        dist = distributed(job, tmp, workers, timeout_s - (time.monotonic() - t0))
    row.update(compare(ref_lines, dist["lines"]))
    row.update(memory_row(ref_mem, dist))
    if dist["stopped"]:
        row["stopped"] = dist["stopped"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2-medium,llama3-1b")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--workers", type=int, default=WORKERS)
    p.add_argument("--batch", type=int, help="batch size for every model (default: SHAPES)")
    p.add_argument("--seq", type=int, help="sequence length for every model (default: SHAPES)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="the PS's and the reference's")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall time for the whole run")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    start, rows = time.monotonic(), []
    for name in args.models.split(","):
        left = args.budget_s - (time.monotonic() - start)
        if left < MIN_LEFT_S and rows:
            rows.append({"model": name, "skipped": f"only {left:.0f} s of --budget-s={args.budget_s:.0f} left"})
            continue
        batch, seq = SHAPES.get(name, (1, None))
        t0 = time.monotonic()
        try:
            row = one(name, args.steps, args.workers, args.device, (args.batch or batch, args.seq or seq), left)
        except (subprocess.SubprocessError, CleaveError) as e:
            err = getattr(e, "stderr", None)
            row = {"model": name, "failed": (str(e) + "\n" + (err.decode(errors="replace") if err else ""))[-2000:]}
        rows.append({**row, "wall_s": round(time.monotonic() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all("failed" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
