"""Fan-out of shared strips: what the PS publishes per step against the distinct inputs of the step's
GEMMs, with fan-out and without, side by side in one run, read from nats-server's own counters.

For 4 and 16 workers on the scheduler's cost plan (`small` preset): a nats-server with its monitoring port
(`/connz`), the local stack on it, and the job run twice (`CLEAVE_PS_FANOUT=true`, then `false`). At each
`step_done` of the PS the benchmark reads `/connz`: the bytes the server received from the PS connection
(everything the PS published) and sent to the worker connections (everything they received) during each
step. Checkpoints are deferred to the job's end (`CLEAVE_PS_PERSIST_EVERY`) so that they do not count.
The distinct inputs are sum over the step's GEMMs of (M + N)·K·4 bytes: every input element once.
Losses are compared with the single-process reference. Writes benchmarks/results/fanout.json.

    .venv/bin/python benchmarks/fanout.py [--workers 4,16] [--steps 4] [--preset small]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from cleave.api.fleet import LocalFleet
from cleave.api.natsconf import free_port, nats_server_binary
from cleave.models import gemm_shapes, get_preset
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer

RESULTS = Path(__file__).parent / "results" / "fanout.json"
WARMUP_STEPS = 1  # the first step runs while plans and fan-out groups settle


class Nats:
    """A nats-server with JetStream and its HTTP monitoring port, for the run."""

    def __init__(self, root: Path) -> None:
        self.port, self.http = free_port(), free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        log = root / "nats.log"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.http), "-js", "-sd",
                 str(root / "js")], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while b"Server is ready" not in log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(log.read_text(errors="replace")[-2000:])
            time.sleep(0.05)

    def connz(self) -> list[dict]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/connz?limit=100000", timeout=5) as r:
            return json.load(r)["connections"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def counters(nats: Nats, job_id: str) -> tuple[int, int]:
    """(bytes the PS of `job_id` published, bytes all workers received), as nats-server counts them."""
    ps = workers = 0
    for c in nats.connz():
        name = c.get("name", "")
        if name in ("ps", f"cleave-ps-{job_id}"):
            ps += c["in_bytes"]
        elif name.startswith(("worker-", "cleave-worker-")):
            workers += c["out_bytes"]
    return ps, workers


def run(nats: Nats, fleet: LocalFleet, job: JobConfig, fanout: bool, run_dir: Path) -> list[dict]:
    """One job; per step, the bytes the PS published and the workers received between step_done lines."""
    metrics = run_dir / f"{job.job_id}.jsonl"
    fleet.start_ps(job, metrics, ps_env={"CLEAVE_PS_FANOUT": str(fanout).lower(), "CLEAVE_LOG_JSON": "1",
                                          "CLEAVE_PS_PERSIST_EVERY": str(job.steps + 1)})
    log = run_dir / "logs" / "ps.log"
    offset = log.stat().st_size if log.exists() else 0
    marks, seen = [counters(nats, job.job_id)], set()
    while True:
        ended = {p.name: p.popen.returncode for p in fleet.stack.supervise()}
        if log.exists():
            for line in log.read_bytes()[offset:].decode(errors="replace").splitlines():
                if '"step_done"' in line:
                    step = json.loads(line)["step"]
                    if step not in seen:
                        seen.add(step)
                        marks.append(counters(nats, job.job_id))
        if "ps" in ended:
            if ended["ps"] != 0:
                raise RuntimeError(f"the PS exited with {ended['ps']}; see {log}")
            break
        time.sleep(0.02)
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    return [{"step": m["step"], "loss": m["loss"], "ps_bytes": marks[i + 1][0] - marks[i][0],
             "workers_bytes": marks[i + 1][1] - marks[i][1], "ps_counted": m["bytes_down"],
             "step_time_s": m["step_time_s"]} for i, m in enumerate(lines[: len(marks) - 1])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="4,16")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--preset", default="small")
    args = ap.parse_args()
    rows = []
    for n in [int(x) for x in args.workers.split(",")]:
        job = JobConfig(job_id=f"fan{n}", preset=args.preset, steps=args.steps)
        cfg = get_preset(job.preset)
        distinct = sum((g.m + g.n) * g.k * 4 * g.count_per_step for g in gemm_shapes(cfg, job.batch_size, job.seq))
        with tempfile.TemporaryDirectory(prefix="cleave-fanout-") as tmp:
            root = Path(tmp)
            nats = Nats(root)
            fleet = LocalFleet(root / "run", n, nats_url=nats.url)
            try:
                fleet.start()
                result = {}
                for fanout in (True, False):
                    steps = run(nats, fleet, job.model_copy(update={"job_id": f"fan{n}-{int(fanout)}"}), fanout,
                                root / "run")
                    result[fanout] = steps
            finally:
                fleet.stop()
                nats.stop()
        trainer = Trainer(job)
        reference = [trainer.step(s) for s in range(job.steps)]
        for fanout, steps in result.items():
            steady = [s for s in steps if s["step"] >= WARMUP_STEPS]
            worst = max(abs(s["loss"] - reference[s["step"]]) / abs(reference[s["step"]]) for s in steps)
            ps = sum(s["ps_bytes"] for s in steady) / len(steady)
            received = sum(s["workers_bytes"] for s in steady) / len(steady)
            row = {"workers": n, "fanout": fanout, "preset": job.preset, "distinct_bytes": distinct,
                   "ps_bytes_per_step": ps, "workers_bytes_per_step": received,
                   "ps_over_distinct": ps / distinct, "workers_over_ps": received / ps,
                   "ps_counted_over_connz": sum(s["ps_counted"] for s in steady) / len(steady) / ps,
                   "step_s": sum(s["step_time_s"] for s in steady) / len(steady),
                   "max_rel_loss_diff": worst, "steps": steps}
            rows.append(row)
            print(f"{n:3d} workers fanout={'on ' if fanout else 'off'}: PS sent {ps / 1e6:8.2f} MB/step = "
                  f"{ps / distinct:5.2f}x the distinct inputs ({distinct / 1e6:.2f} MB); workers received "
                  f"{received / 1e6:8.2f} MB ({received / ps:4.2f}x the PS's); step {row['step_s']:.2f} s; "
                  f"max loss diff vs reference {worst:.1e}")
        on, off = rows[-2], rows[-1]
        print(f"{n:3d} workers: fan-out cuts the PS's egress {off['ps_bytes_per_step'] / on['ps_bytes_per_step']:.2f}x")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
