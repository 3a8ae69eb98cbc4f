"""Convergence benchmark: the `small` preset on real text, distributed with churn, against the reference.

The corpus is the Python standard library's own source (`<stdlib>/*.py` of the running interpreter, about
4.7 MB, in sorted file order), pre-tokenised once with `prepare_data` into a byte-level token file, so the
run also exercises the token-file path. Two runs of the same job:
  reference  one process, plain PyTorch (`cleave train --reference`)
  cleave     a local stack on loopback with WORKERS workers; every --kill-every steps the oldest worker is
             SIGKILLed and a fresh one joins (its tiles are re-sent within the step)
Both evaluate val_loss on the held-out last 10% every --val-every steps. Writes
benchmarks/results/convergence.json and docs/img/convergence.png (loss curves overlaid, kills marked).

    .venv/bin/python benchmarks/convergence.py [--steps 1000] [--kill-every 100] [--workers 3]

Needs matplotlib (`pip install matplotlib`) for the figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

from cleave.api.fleet import LocalFleet, run_reference
from cleave.models.tokenizer import ByteTokenizer
from cleave.train.job import JobConfig
from cleave.train.sources import prepare_data

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "convergence.json"
FIGURE = ROOT / "docs" / "img" / "convergence.png"
DEFAULT_TIMEOUT_S = 6 * 3600


def stdlib_corpus(out: Path) -> dict:
    """The interpreter's top-level stdlib modules as a byte-level token file; returns what it holds."""
    source = f"{sysconfig.get_paths()['stdlib']}/*.py"
    stats = prepare_data(source, ByteTokenizer(), out)
    return {
        "source": source,
        "python": platform.python_version(),
        "documents": stats.documents,
        "tokens": stats.tokens,
        "sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
    }


def run_cleave(job: JobConfig, run_dir: Path, workers: int, kill_every: int) -> tuple[list[dict], list[dict]]:
    """The job on a local stack with a worker killed (and replaced) every `kill_every` steps."""
    fleet = LocalFleet(run_dir, workers)
    live = [f"worker-{i + 1}" for i in range(workers)]
    kills: list[dict] = []

    def on_line(m: dict) -> None:
        done = m["step"] + 1
        if kill_every and done % kill_every == 0 and done < job.steps:
            victim = live.pop(0)
            fleet.stack.kill(victim, restart=False)
            live.append(fleet.add_worker())
            kills.append({"after_step": done, "killed": victim, "replacement": live[-1], "at": time.time()})
            print(f"step {done}: killed {victim}, started {live[-1]}", flush=True)
        if done % 25 == 0:
            print(f"cleave step {done}/{job.steps} loss {m['loss']:.4f}", flush=True)

    try:
        fleet.start()
        fleet.start_ps(job, run_dir / "metrics.jsonl")
        lines = fleet.wait_ps(run_dir / "metrics.jsonl", on_line, timeout_s=DEFAULT_TIMEOUT_S)
    finally:
        fleet.stop()
    return lines, kills


def curve(lines: list[dict]) -> dict:
    val = {m["step"]: m["val_loss"] for m in lines if m.get("val_loss") is not None}
    return {
        "loss": [m["loss"] for m in lines],
        "val_loss": val,
        "median_step_s": statistics.median(m["step_time_s"] for m in lines),
    }


def summarize(ref: dict, dist: dict, tail: int) -> dict:
    diffs = [abs(a - b) for a, b in zip(ref["loss"], dist["loss"], strict=True)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    last_val = max(ref["val_loss"]) if ref["val_loss"] else None
    return {
        "first_loss": ref["loss"][0],
        "final_loss_reference": ref["loss"][-1],
        "final_loss_cleave": dist["loss"][-1],
        f"mean_loss_last_{tail}_reference": mean(ref["loss"][-tail:]),
        f"mean_loss_last_{tail}_cleave": mean(dist["loss"][-tail:]),
        "final_val_loss_reference": ref["val_loss"].get(last_val),
        "final_val_loss_cleave": dist["val_loss"].get(last_val),
        "max_abs_loss_diff": max(diffs),
        "mean_abs_loss_diff": mean(diffs),
        "first_step_diff_over_1e-3": next((i for i, d in enumerate(diffs) if d > 1e-3), None),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref, dist = result["reference"], result["cleave"]
    steps = range(1, len(ref["loss"]) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, height_ratios=(3, 1))
    top.plot(steps, ref["loss"], color="#9ecae1", lw=3, label="reference (one process, plain PyTorch)")
    top.plot(
        steps, dist["loss"], color="#08306b", lw=0.8, label=f"Cleave, {result['workers']} workers, with churn"
    )
    for name, c, color in (("reference", ref, "#fd8d3c"), ("cleave", dist, "#7f2704")):
        val = sorted((int(k) + 1, v) for k, v in c["val_loss"].items())
        if val:
            top.plot(
                *zip(*val, strict=True),
                "o" if name == "reference" else "x",
                color=color,
                ms=7 if name == "reference" else 6,
                label=f"val_loss, {name}",
            )
    for i, k in enumerate(dist["kills"]):
        for ax in (top, bottom):
            ax.axvline(
                k["after_step"],
                color="#d62728",
                ls=":",
                lw=1,
                label="worker SIGKILLed" if i == 0 and ax is top else None,
            )
    top.set_ylabel("cross-entropy (nats / byte)")
    top.set_title(
        f"preset {result['preset']} on the Python stdlib source ({result['data']['tokens'] / 1e6:.1f} M byte tokens), "
        f"{len(ref['loss'])} steps",
        fontsize=10,
    )
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.plot(
        steps, [b - a for a, b in zip(ref["loss"], dist["loss"], strict=True)], color="#08306b", lw=0.8
    )
    bottom.set_ylabel("Cleave − reference")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument(
        "--kill-every", type=int, default=100, help="SIGKILL a worker after every N steps (0: never)"
    )
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--val-every", type=int, default=50)
    p.add_argument("--preset", default="small")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--figure", type=Path, default=FIGURE)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="cleave-convergence-") as tmp:
        tmp = Path(tmp)
        data = stdlib_corpus(tmp / "stdlib.u16")
        print(
            f"corpus: {data['tokens']:,} tokens from {data['documents']} files ({data['source']})", flush=True
        )
        job = JobConfig(
            job_id="convergence",
            preset=args.preset,
            steps=args.steps,
            data=str(tmp / "stdlib.u16"),
            val_every=args.val_every,
        )
        t0 = time.time()
        ref = curve(run_reference(job, tmp / "reference.jsonl"))
        ref["wall_s"] = time.time() - t0
        print(
            f"reference: loss {ref['loss'][0]:.4f} -> {ref['loss'][-1]:.4f} in {ref['wall_s']:.0f}s",
            flush=True,
        )
        t0 = time.time()
        lines, kills = run_cleave(job, tmp / "cleave", args.workers, args.kill_every)
        dist = {
            **curve(lines),
            "wall_s": time.time() - t0,
            "kills": kills,
            "recoveries": sum(m["recoveries"] for m in lines),
            "tiles_resent": sum(m["tiles_resent"] for m in lines),
            "tiles": sum(m["tiles"] for m in lines),
        }
    result = {
        "preset": args.preset,
        "steps": args.steps,
        "workers": args.workers,
        "kill_every": args.kill_every,
        "batch_size": job.batch_size,
        "seq_len": job.seq,
        "lr": job.lr,
        "val_every": args.val_every,
        "data": data,
        "summary": summarize(ref, dist, tail=min(50, args.steps)),
        "reference": ref,
        "cleave": dist,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1))
    plot(result, args.figure)
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {args.results} and {args.figure}")


if __name__ == "__main__":
    main()
