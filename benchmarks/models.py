"""The mission's models through Cleave beside `--reference`, on this machine: memory, step time, checkpoints.

Each model trains at its real batch (GPT-2 Medium 8 x 1024, Llama 3.2 1B 4 x 1024) with the PS given a
memory budget (`BUDGET_GB`: what its peak must stay under on this 24 GB machine): the preflight decides
`recompute` against it, as the PS would (`cleave.train.preflight.resolve`), and its estimate is recorded (a
job it refuses is reported as refused, not run). Then the single-process reference with the same options
(`cleave train --reference`, its peak RSS from the kernel's rusage of the child), then the same job through a
local stack with WORKERS workers (the peak RSS of the PS and of each worker read from /proc as they run, VmHWM,
and the stack's largest resident sum at one moment). Prints and records,
side by side from the one run: the PS's peak RSS against the budget and against the preflight's estimate,
the reference's peak, median step time / the reference's, checkpoint seconds per step (the streamed
commits, `checkpoint_s`), and whether the losses are equal. Writes benchmarks/results/models.json.

The machine is shared: this checks `MemAvailable` first and stops a run when it falls under MIN_FREE_GB.

    nice -n 10 .venv/bin/python benchmarks/models.py [--models gpt2-medium,llama3-1b] [--steps 2]

The PS's settings come from the environment as for `cleave train`: Llama 3.2 1B fits the 22 GB budget only with
fewer weight gradients dealt beside the backward than the PS's default 8; the preflight lowers them to the most
that fit (2), as the PS does, and the row records how many (`deferred_gemms`).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from cleave.api.fleet import LocalFleet
from cleave.errors import CleaveError
from cleave.runtime.memory import resident
from cleave.train import preflight
from cleave.train.job import JobConfig
from cleave_ps.settings import PsSettings

RESULTS = Path(__file__).parent / "results" / "models.json"
WORKERS = 2
MIN_FREE_GB = 0.5  # the machine's memory left to everything else while a model trains (else the PS is stopped)
JOBS = {  # the mission's batches, and the PS's memory budget on this 24 GB, 2-core machine
    "gpt2-medium": dict(batch_size=8, seq_len=1024),
    "llama3-1b": dict(batch_size=4, seq_len=1024),
}
BUDGET_GB = {"gpt2-medium": 16.0, "llama3-1b": 22.0}
KIB_GB = 1024 / 1e9  # rusage counts KiB; GB here are 1e9 bytes, as the preflight counts


def free_gb() -> float:
    return preflight.available_memory() / 1e9


class PeakWatch(threading.Thread):
    """Polls every process of the stack (the PS, nats-server, the scheduler, the workers): each one's VmHWM (peak
    RSS), and the largest sum of their resident memory at one moment; stops the PS (for good) if the machine's
    free memory falls under MIN_FREE_GB."""

    def __init__(self, fleet: LocalFleet) -> None:
        super().__init__(daemon=True)
        self.fleet, self.peak, self.stack, self.low = fleet, {"ps": 0, "nats": 0}, 0, None  # bytes
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            now = 0
            for name, proc in list(self.fleet.stack.procs.items()):
                if proc.popen is not None and proc.popen.poll() is None:  # (None: stopped)
                    hwm, rss = resident(proc.popen.pid)
                    self.peak[name] = max(self.peak.get(name, 0), hwm)
                    now += rss
            self.stack = max(self.stack, now)
            if self.low is None and free_gb() < MIN_FREE_GB:
                self.low = f"stopped: the machine's free memory fell to {free_gb():.1f} GB"
                self.fleet.stack.kill("ps", restart=False)


def reference(job_file: Path, tmp: Path) -> tuple[list[dict], float]:
    out = tmp / "ref.jsonl"
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    subprocess.run([sys.executable, "-m", "cleave_cli", "train", "--config", str(job_file), "--reference",
                    "--metrics-out", str(out), "--run-dir", str(tmp / "ref")], check=True, capture_output=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:
        raise CleaveError("the reference's peak RSS is hidden by an earlier, larger child; run one model at a time")
    return [json.loads(line) for line in out.read_text().splitlines()], peak * KIB_GB


def distributed(job: JobConfig, tmp: Path, budget: preflight.Memory) -> dict:
    """The job through a local stack, its PS held to `budget` (CLEAVE_PS_MEMORY_BYTES): its lines, peak RSS of
    the PS, nats-server and each worker, the whole stack's largest resident memory at one moment, what the PS
    logged."""
    fleet = LocalFleet(tmp / "dist", WORKERS)
    watch = PeakWatch(fleet)
    lines, stopped = [], None
    try:
        fleet.start()
        watch.start()
        fleet.start_ps(job, tmp / "dist.jsonl", ps_env={"CLEAVE_PS_MEMORY_BYTES": str(budget.host)})
        lines = fleet.wait_ps(tmp / "dist.jsonl", timeout_s=3600)
    except CleaveError as e:
        stopped = watch.low or str(e)
        lines = [json.loads(x) for x in (tmp / "dist.jsonl").read_text().splitlines()] if (tmp / "dist.jsonl").exists() else []
    finally:
        watch.done.set()
        fleet.stop()
    log = (tmp / "dist" / "logs" / "ps.log").read_text()
    return {"lines": lines, "stopped": stopped, "ps_gb": watch.peak["ps"] / 1e9, "nats_gb": watch.peak["nats"] / 1e9,
            "workers_gb": [watch.peak[w] / 1e9 for w in sorted(watch.peak) if w.startswith("worker")],
            "stack_gb": watch.stack / 1e9,
            "ps_restarts": len(re.findall(r"ps_resumed", log)),
            "peak_rss_at_step_end_mb": [float(x) for x in re.findall(r"step_done.*?peak_rss_mb=([0-9.]+)", log)]}


def one(name: str, steps: int) -> dict:
    budget = preflight.Memory(int(BUDGET_GB[name] * 1e9))
    ps = PsSettings()  # the PS started below: the most it defers (CLEAVE_PS_DEFERRED_GEMMS), the outputs it keeps
    job, est = preflight.resolve(JobConfig(job_id=f"bench-{name}", preset=name, steps=steps, **JOBS[name]), budget,
                                 WORKERS, deferred=ps.deferred_gemms, pool=ps.product_pool_bytes)
    row = {"model": name, "batch_size": job.batch_size, "seq_len": job.seq, "steps": steps, "workers": WORKERS,
           "budget_gb": BUDGET_GB[name], "deferred_gemms": est.deferred[0], "recompute": job.recompute, "micro_batches": job.micro_batches,
           "head_chunks": est.layout.head_chunks, "estimate_gb": round(est.total / 1e9, 2),
           "estimate_at": est.peak_phase, "free_gb_before": round(free_gb(), 1)}
    try:
        preflight.check(job, est, budget)
        preflight.check(job, est, int((free_gb() - MIN_FREE_GB) * 1e9))
    except CleaveError as e:
        return {**row, "refused": str(e)}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "job.json").write_text(job.model_dump_json())
        ref, ref_gb = reference(tmp / "job.json", tmp)
        dist = distributed(job, tmp, budget)
    lines = dist["lines"]
    ref_step = statistics.median(m["step_time_s"] for m in ref)
    row = {**row, "ps_peak_rss_gb": round(dist["ps_gb"], 2), "under_budget": dist["ps_gb"] < BUDGET_GB[name],
           "estimate_over_measured": round(est.total / 1e9 / dist["ps_gb"], 3) if dist["ps_gb"] else None,
           "reference_peak_rss_gb": round(ref_gb, 2),
           "rss_ratio": round(dist["ps_gb"] / ref_gb, 3), "nats_peak_rss_gb": round(dist["nats_gb"], 2),
           "workers_peak_rss_gb": [round(w, 2) for w in dist["workers_gb"]], "stack_peak_rss_gb": round(dist["stack_gb"], 2),
           "ps_restarts": dist["ps_restarts"],
           "ps_peak_rss_at_step_end_mb": dist["peak_rss_at_step_end_mb"], "reference_step_s": round(ref_step, 2),
           "reference_losses": [m["loss"] for m in ref], "losses": [m["loss"] for m in lines]}
    if dist["stopped"]:
        row["stopped"] = dist["stopped"]
    if lines:
        step = statistics.median(m["step_time_s"] for m in lines)
        row.update(step_s=round(step, 2), step_ratio=round(step / ref_step, 2),
                   checkpoint_s=[round(m.get("checkpoint_s", 0.0), 1) for m in lines],
                   checkpoint_s_per_step=round(sum(m.get("checkpoint_s", 0.0) for m in lines) / len(lines), 2),
                   losses_equal=[m["loss"] for m in lines] == [m["loss"] for m in ref[: len(lines)]],
                   max_rel_loss_diff=max(abs(m["loss"] - r["loss"]) / abs(r["loss"]) for m, r in zip(lines, ref, strict=False)))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2-medium,llama3-1b")
    p.add_argument("--steps", type=int, default=2, help="1 measures the peak (AdamW's moments are held from the first step on); 2 also compares a step taken with them")
    args = p.parse_args()
    rows = json.loads(RESULTS.read_text())["rows"] if RESULTS.exists() else []
    for name in args.models.split(","):
        rows = [r for r in rows if r["model"] != name]  # a model measured again replaces its old row
        if free_gb() < MIN_FREE_GB + 2:
            rows.append({"model": name, "skipped": f"only {free_gb():.1f} GB free"})
            continue
        t0 = time.time()
        rows.append({**one(name, args.steps), "wall_s": round(time.time() - t0)})
        print(json.dumps(rows[-1]), flush=True)
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps({"rows": rows}, indent=2) + "\n")  # after each model: nothing is lost
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
