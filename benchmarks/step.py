"""Step benchmark: the fleet's step against the reference and against an honest floor, in one run.

For each preset: the reference step (one process, plain PyTorch, the same precision); the distributed step
(a local nats-server, the scheduler and N worker processes; the PS itself runs in this process, so that
where its CPU goes can be sampled, `floors.CpuSampler`); then, on the same nats-server, the floor:

    floor = max(bytes the PS sent and received / the bus's rate, the step's GEMM FLOPs / the GEMM rate)

with the bus's best rate measured with as many concurrent publisher/subscriber process pairs as workers and
with one publisher to as many subscribers, at the message sizes the step used (`floors.bus_rate_measure`, per
direction, the best of 2 tries of each right after the step), and the GEMM rate with all threads at the
step's shapes (the better of before and after the step). Prints step/floor, distributed/reference, the PS's
CPU seconds per step split into serialisation, copies, bus, local compute and Python, and the fraction of
the workers' time spent idle (1 - their compute seconds, from their heartbeats, over workers x wall time), and
the PS's CPU seconds per step in Freivalds' check of every result block (`cleave_ps.fleet.freivalds`) with its
share of the step (the aim: under 5%), and the tiles resent after a missed deadline and copied over the run.
On a machine that runs the whole stack, what bounds the step is the CPU of all of it: it also prints every
process's CPU seconds per step by role (the PS in this one, the workers, nats-server, the scheduler; from
/proc), how busy the machine's cores were over the steps (every process's time, other tenants' too), and the
CPU the bare bus spends on the step's bytes: the whole machine's busy CPU per byte over the floor's measurement
(nats-server's and the bare nats-py clients'), and the clients' alone (a publisher's and a subscriber's, per
byte of each direction), against the stack's (`stack_cpu_over_bus`). Where the whole stack shares the
machine, no step can be shorter than `machine_bound_s`: the CPU the reference spends on a step plus the bare
bus's for its bytes, over the machine's cores; `machine_bound_over_floor` says how far above the floor that
sits on this machine, `step_over_machine_bound` what the stack's own overhead adds to it.
The losses are compared with the reference's: whether they are equal, and whether they differ by at most twice
PyTorch's own spread (`SPREAD_RUNS`: the reference again as other machines sum it, each combination of one
thread, ATen's kernels at AVX2 width or not vectorised and MKL's GEMMs without AVX-512, as compose/e2e.sh measures it): BLAS may round a tile's product, of another shape than the reference's one
product, differently in a float's last bit, and a step's loss then differs by about that.
Each point runs with the PS dealing one GEMM at a time (`--deferred 0`) and with weight gradients dealt
beside the backward's other GEMMs (`deferred_gemms`, 8 by default), side by side.
The tiles are uniform, 256 x 256 from a queue, as this benchmark has always measured; `--planner cost` runs the
scheduler's own plan, as `cleave train` does (`--chunks`: its pieces per planned block).
Writes benchmarks/results/step.json.

    nice -n 10 .venv/bin/python benchmarks/step.py [--presets tiny small] [--steps 12] [--workers 4]
                                                   [--precision fp32|bf16|fp16] [--deferred 0 8]
                                                   [--planner uniform|cost|even] [--chunks N] [--batch-size B]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import floors

from cleave import bus as busmod
from cleave.api.fleet import LocalFleet, MetricsTail
from cleave.gemm import tiles
from cleave.runtime.logs import configure
from cleave.runtime.threads import spread_runs
from cleave.schemas import SUBJECT_HEARTBEAT_ALL, SUBJECT_RESULTS, Heartbeat
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from cleave_ps.jobs import lifecycle
from cleave_ps.jobs.pretrain import Pretrain
from cleave_ps.settings import PsSettings

WARMUP_STEPS = 2
RESULTS = Path(__file__).parent / "results" / "step.json"
# PyTorch's own run-to-run spread, as compose/e2e.sh measures it (each run in a process of its own: torch reads
# these when it is imported)
SPREAD_RUNS = spread_runs()
_REFERENCE = ("import json, sys; sys.path.insert(0, sys.argv[1]); import step; from cleave.train.job import JobConfig; "
              "print(json.dumps(step.reference(JobConfig.model_validate_json(sys.argv[2]), int(sys.argv[3]))[1]))")


def reference(job: JobConfig, steps: int) -> tuple[float, list[float], float]:
    """The reference's median step, its losses and its median CPU seconds a step (every thread of this process)."""
    trainer = Trainer(job)
    times, losses, cpu = [], [], []
    for s in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(trainer.step(s))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(times[WARMUP_STEPS:]), losses, statistics.median(cpu[WARMUP_STEPS:])


def spread(job: JobConfig, steps: int, losses: list[float]) -> float:
    """The largest relative difference from `losses` (the reference's) of the reference run with SPREAD_RUNS'
    other kernels."""
    worst = 0.0
    for env in SPREAD_RUNS.values():
        out = subprocess.run([sys.executable, "-c", _REFERENCE, str(Path(__file__).parent), job.model_dump_json(), str(steps)],
                             env={**os.environ, **env}, capture_output=True, text=True, check=True)
        other = json.loads(out.stdout.strip().splitlines()[-1])
        worst = max(worst, max(abs(o - r) / abs(r) for o, r in zip(other, losses, strict=True)))
    return worst


class Recorder:
    """What the in-process PS puts on and takes off the bus (message sizes, with times), and the workers'
    heartbeats; observed by wrapping the PS's own Bus object, nothing replaced."""

    def __init__(self, bus: busmod.Bus) -> None:
        self.bus, self.down, self.up = bus, [], []
        self.beats: dict[str, list[tuple[float, float]]] = defaultdict(list)
        publish, subscribe = bus.publish_pieces, bus.subscribe  # publish_frame calls publish_pieces

        async def publish_pieces(subject: str, pieces: list, **kw) -> int:  # noqa: ANN003
            self.down.append((time.time(), sum(len(p) for p in pieces)))
            return await publish(subject, pieces, **kw)

        async def sub(subject: str, schema, handler, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            if not subject.startswith(SUBJECT_RESULTS.split("{", 1)[0]):
                return await subscribe(subject, schema, handler, *args, **kw)

            async def seen(msg, nbytes: int) -> None:  # noqa: ANN001
                self.up.append((time.time(), nbytes))
                await handler(msg, nbytes)

            return await subscribe(subject, schema, seen, *args, **kw)

        bus.publish_pieces, bus.subscribe = publish_pieces, sub

    async def on_beat(self, hb: Heartbeat, nbytes: int) -> None:
        self.beats[hb.worker_id].append((time.time(), hb.busy_s))

    def part_sizes(self, frames: list[tuple[float, int]], t0: float, t1: float) -> Counter:
        """Bytes moved per message size in [t0, t1] (a frame over max_payload travels in max_payload parts)."""
        cap, out = self.bus.max_payload, Counter()
        for t, n in frames:
            if t0 <= t <= t1:
                out[min(n, cap)] += n
        return out

    def busy_s(self, t0: float, t1: float) -> float:
        """The workers' compute seconds in [t0, t1], from their cumulative busy_s (interpolated)."""

        def at(beats: list[tuple[float, float]], t: float) -> float:
            before = [b for b in beats if b[0] <= t] or beats[:1]
            after = [b for b in beats if b[0] >= t] or beats[-1:]
            (ta, ba), (tb, bb) = before[-1], after[0]
            return ba if tb <= ta else ba + (bb - ba) * (t - ta) / (tb - ta)

        return sum(at(b, t1) - at(b, t0) for b in self.beats.values() if b)


def weighted_median(sizes: Counter) -> int:
    """The message size below and above which half the bytes travel."""
    total, acc = sum(sizes.values()), 0
    for size in sorted(sizes):
        acc += sizes[size]
        if acc * 2 >= total:
            return size
    return tiles.UNPLANNED_TILE


class Measured(Pretrain):
    """The pretraining driver, noting after each step the CPU seconds its checks of result blocks took so far."""

    def __init__(self, *args, **kw) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kw)
        self.verify_cpu: dict[int, float] = {}  # step -> Freivalds' CPU seconds up to its end
        self.gemm_walls: list[tuple[int, float]] = []  # (step, seconds from a GEMM's dealing to its product)
        self.others: dict[str, tuple[str, int]] = {}  # the other processes of the stack: name -> (role, pid)
        # step -> at its end: the other processes' CPU seconds by role, and the machine's (busy, all) CPU seconds
        self.cpu_at: dict[int, tuple[Counter, tuple[float, float]]] = {}

    async def build(self, epoch: int, plans) -> None:  # noqa: ANN001
        await super().build(epoch, plans)
        gemm = self.dispatcher.gemm

        async def timed(a, bt, step: int, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            out = await gemm(a, bt, step, *args, **kw)
            self.gemm_walls.append((step, time.perf_counter() - t0))
            return out

        self.dispatcher.gemm = timed

    async def commit(self, m) -> None:  # noqa: ANN001
        self.verify_cpu[m.step] = self.dispatcher.c.verify_cpu_s
        by_role = Counter()
        for role, pid in self.others.values():
            by_role[role] += floors.cpu_s(pid)
        self.cpu_at[m.step] = by_role, floors.machine_cpu()
        await super().commit(m)


def scheduler_env(planner: str, chunks: int | None) -> dict[str, str]:
    """The scheduler's settings for `--planner`: uniform tiles of UNPLANNED_TILE (this benchmark's figures
    before it had the option, comparable), or the scheduler's own plan (`cost`: its defaults, `--chunks` too)."""
    if planner == "uniform":
        return {"CLEAVE_SCHEDULER_PLANNER": "uniform", "CLEAVE_SCHEDULER_TILE_ROWS": str(tiles.UNPLANNED_TILE),
                "CLEAVE_SCHEDULER_TILE_COLS": str(tiles.UNPLANNED_TILE)}
    return {"CLEAVE_SCHEDULER_PLANNER": planner, **({"CLEAVE_SCHEDULER_CHUNKS": str(chunks)} if chunks else {})}


async def distributed(job: JobConfig, workers: int, run_dir: Path, deferred: int, env: dict[str, str]) -> dict:
    fleet = LocalFleet(run_dir, workers, scheduler_env=env)
    fleet.start()
    try:
        fleet.wait_joined()  # the first step's plan has every worker: its tiles have the shapes of the later steps
        url, metrics = fleet.stack.nats_url, run_dir / "metrics.jsonl"
        bus = await busmod.connect(url, f"cleave-ps-{job.job_id}")
        await bus.setup()
        rec = Recorder(bus)
        await bus.subscribe(SUBJECT_HEARTBEAT_ALL, Heartbeat, rec.on_beat)
        sampler = floors.CpuSampler()
        sampler.start()
        try:
            settings = PsSettings(nats_url=url, metrics_out=metrics, deferred_gemms=deferred)
            driver = Measured(settings, job, bus)
            driver.others = {p.name: (p.role, p.popen.pid) for p in fleet.stack.procs.values() if p.popen is not None}
            code = await lifecycle.run(driver, bus, asyncio.Event())
        finally:
            sampler.stop()
            await bus.close()
        assert code == 0, f"the PS exited with {code}"
        lines = MetricsTail(metrics).read()
        ends = {m["step"]: m["at"] for m in lines}
        t0, t1 = ends[WARMUP_STEPS - 1], ends[job.steps - 1]
        body = [m for m in lines if m["step"] >= WARMUP_STEPS]
        down, up = rec.part_sizes(rec.down, t0, t1), rec.part_sizes(rec.up, t0, t1)
        size_down, size_up = weighted_median(down), weighted_median(up)
        bus_down = await floors.bus_rate_measure(url, workers, size_down)
        bus_up = await floors.bus_rate_measure(url, workers, size_up)
        _, gemm_after = floors.gemm_seconds(job.arch(), job.batch_size, job.seq)
    finally:
        fleet.stop()
    n = len(body)
    verify_s = (driver.verify_cpu[job.steps - 1] - driver.verify_cpu[WARMUP_STEPS - 1]) / n
    (roles0, machine0), (roles1, machine1) = driver.cpu_at[WARMUP_STEPS - 1], driver.cpu_at[job.steps - 1]
    ps_cpu = sampler.between(t0, t1)
    # the bare nats-py clients' CPU for the step's bytes: a publisher's and a subscriber's per byte, each direction
    moved = ((statistics.median(m["bytes_down"] for m in body), bus_down),
             (statistics.median(m["bytes_up"] for m in body), bus_up))
    clients_s = sum(nbytes * (b["publisher_ns_per_byte"] + b["subscriber_ns_per_byte"]) / 1e9 for nbytes, b in moved)
    bare_s = sum(nbytes * b["machine_ns_per_byte"] / 1e9 for nbytes, b in moved)  # nats-server's CPU too
    return {
        "verify_cpu_s_per_step": verify_s, "verified_blocks": driver.dispatcher.c.verified,
        "lines": lines, "step_s": statistics.median(m["step_time_s"] for m in body),
        "bytes_down": statistics.median(m["bytes_down"] for m in body),
        "bytes_up": statistics.median(m["bytes_up"] for m in body),
        "msg_bytes_down": size_down, "msg_bytes_up": size_up,
        "bus_rate_down": bus_down["bytes_per_s"], "bus_rate_up": bus_up["bytes_per_s"],
        "ps_cpu_per_step": {k: v / n for k, v in ps_cpu.items()},
        "stack_cpu_per_step": {"ps": ps_cpu["cpu_s"] / n, **{r: (roles1[r] - roles0[r]) / n for r in sorted(roles1)}},
        "machine_busy": (machine1[0] - machine0[0]) / (machine1[1] - machine0[1]), "bus_clients_cpu_s": clients_s,
        "bus_machine_cpu_s": bare_s,
        "worker_idle_fraction": 1 - rec.busy_s(t0, t1) / (workers * (t1 - t0)),
        "tiles_per_step": statistics.median(m["tiles"] for m in body), "gemm_s_after": gemm_after,
        "gemm_walls": [w for step, w in driver.gemm_walls if step >= WARMUP_STEPS],
    }


def bench(preset: str, steps: int, workers: int, precision: str, deferred: int, planner: str = "uniform",
          chunks: int | None = None, batch_size: int | None = None) -> dict:
    job = JobConfig(job_id=f"bench-{preset}-{time.time_ns()}", preset=preset, steps=steps, precision=precision,
                    **({"batch_size": batch_size} if batch_size else {}))
    ref_s, ref_losses, ref_cpu = reference(job, steps)
    envelope = spread(job, steps, ref_losses)
    flops, gemm_s = floors.gemm_seconds(job.arch(), job.batch_size, job.seq)  # workers compute in float32
    with tempfile.TemporaryDirectory() as tmp:
        d = asyncio.run(distributed(job, workers, Path(tmp), deferred, scheduler_env(planner, chunks)))
    gemm_s = min(gemm_s, d["gemm_s_after"])  # the best rate, before or after the step
    bus_s = d["bytes_down"] / d["bus_rate_down"] + d["bytes_up"] / d["bus_rate_up"]
    floor = max(bus_s, gemm_s)
    return {
        "preset": preset, "batch_size": job.batch_size, "seq": job.seq, "workers": workers, "steps": steps,
        "precision": precision, "deferred_gemms": deferred,
        "planner": planner, "chunks": None if planner == "uniform" else chunks or tiles.DEFAULT_CHUNKS,
        "reference_step_s": ref_s, "distributed_step_s": d["step_s"], "distributed_over_reference": d["step_s"] / ref_s,
        "ps_bytes_down_per_step": d["bytes_down"], "ps_bytes_up_per_step": d["bytes_up"],
        "msg_bytes_down": d["msg_bytes_down"], "msg_bytes_up": d["msg_bytes_up"],
        "bus_pairs": workers, "bus_bytes_per_s_down": d["bus_rate_down"], "bus_bytes_per_s_up": d["bus_rate_up"],
        "bus_floor_s": bus_s, "gemm_flops_per_step": flops, "gemm_s_all_threads": gemm_s,
        "gemm_flops_per_s": flops / gemm_s, "floor_s": floor, "floor_is": "bus" if bus_s >= gemm_s else "gemm",
        "step_over_floor": d["step_s"] / floor, "ps_cpu_s_per_step": d["ps_cpu_per_step"],
        # every process of the stack, the PS in this one: CPU seconds per step, by role; the machine's cores busy
        # over the steps (other tenants' processes too); bare nats-py clients' CPU for the step's bytes
        "stack_cpu_s_per_step": d["stack_cpu_per_step"], "stack_cpu_s": sum(d["stack_cpu_per_step"].values()),
        "machine_busy_fraction": d["machine_busy"], "cores": os.cpu_count(),
        "bus_clients_cpu_s_per_step": d["bus_clients_cpu_s"], "bus_machine_cpu_s_per_step": d["bus_machine_cpu_s"],
        "stack_cpu_over_bus": sum(d["stack_cpu_per_step"].values()) / d["bus_machine_cpu_s"],
        # where the whole stack shares this machine's cores, no step is shorter than the CPU plain PyTorch spends
        # on it plus the bare bus's for its bytes, spread over every core (were nothing else spent)
        "reference_cpu_s_per_step": ref_cpu,
        "machine_bound_s": (bound := (ref_cpu + d["bus_machine_cpu_s"]) / os.cpu_count()),
        "machine_bound_over_floor": bound / floor, "step_over_machine_bound": d["step_s"] / bound,
        "worker_idle_fraction": d["worker_idle_fraction"], "tiles_per_step": d["tiles_per_step"],
        "losses": [m["loss"] for m in d["lines"]], "losses_equal_reference": [m["loss"] for m in d["lines"]] == ref_losses,
        "max_rel_loss_diff": (diff := max(abs(m["loss"] - r) / abs(r) for m, r in zip(d["lines"], ref_losses, strict=True))),
        # within twice PyTorch's own spread, compose/e2e.sh's rule (without its floor of 1e-4 for long runs)
        "pytorch_spread": envelope, "losses_within_spread": diff <= 2 * envelope,
        "verify_cpu_s_per_step": d["verify_cpu_s_per_step"], "verify_share_of_step": d["verify_cpu_s_per_step"] / d["step_s"],
        "verified_blocks": d["verified_blocks"],
        "gemms_per_step": len(d["gemm_walls"]) / (steps - WARMUP_STEPS),
        "gemm_wall_s": {q: statistics.quantiles(d["gemm_walls"], n=20)[i] for q, i in (("p5", 0), ("p50", 9), ("p95", 18))},
        # tiles sent again after a missed deadline (cut for several workers: other shapes, which BLAS may round
        # differently from the reference's product) and copies of late tiles, over every step
        "tiles_resent": sum(m["tiles_resent"] for m in d["lines"]), "tiles_copied": sum(m["tiles_copied"] for m in d["lines"]),
    }


def report(r: dict) -> str:
    cpu = r["ps_cpu_s_per_step"]
    split = ", ".join(f"{k} {cpu[k]:.3f}" for k in floors.CATEGORIES)
    stack = ", ".join(f"{k} {v:.3f}" for k, v in r["stack_cpu_s_per_step"].items())
    plan = r["planner"] + (f" chunks {r['chunks']}" if r["chunks"] else "")
    return (f"{r['preset']:>6} batch {r['batch_size']}x{r['seq']} {r['precision']} deferred {r['deferred_gemms']} "
            f"{plan} ({r['tiles_per_step']:.0f} tiles a step): step {r['distributed_step_s']:.3f}s vs reference "
            f"{r['reference_step_s']:.3f}s (x{r['distributed_over_reference']:.1f}); floor {r['floor_s']:.3f}s "
            f"({r['floor_is']}: bus {r['bus_floor_s']:.3f}s at {r['bus_bytes_per_s_down'] / 1e6:.0f}/"
            f"{r['bus_bytes_per_s_up'] / 1e6:.0f} MB/s down/up with {r['bus_pairs']} pairs, GEMMs "
            f"{r['gemm_s_all_threads']:.3f}s at {r['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s) -> step/floor "
            f"{r['step_over_floor']:.2f}; losses equal to the reference: {r['losses_equal_reference']} "
            f"(largest relative difference {r['max_rel_loss_diff']:.1e}, PyTorch's own spread {r['pytorch_spread']:.1e}: "
            f"{'within' if r['losses_within_spread'] else 'OUTSIDE'} twice it; tiles resent {r['tiles_resent']}, "
            f"copied {r['tiles_copied']})"
            f"\n        {r['gemms_per_step']:.0f} GEMMs a step, each {r['gemm_wall_s']['p5'] * 1e3:.1f}-"
            f"{r['gemm_wall_s']['p95'] * 1e3:.1f} ms from dealing to product (5-95%; median "
            f"{r['gemm_wall_s']['p50'] * 1e3:.1f} ms)"
            f"\n        PS CPU per step {cpu['cpu_s']:.3f}s: {split}; "
            f"worker idle {r['worker_idle_fraction']:.0%}"
            f"\n        the stack's CPU per step {r['stack_cpu_s']:.3f}s ({stack}) on {r['cores']} cores "
            f"{r['machine_busy_fraction']:.0%} busy; the bare bus's {r['bus_machine_cpu_s_per_step']:.3f}s for the "
            f"step's bytes (its nats-py clients' {r['bus_clients_cpu_s_per_step']:.3f}s; the machine's CPU over "
            f"the floor's measurement): x{r['stack_cpu_over_bus']:.1f}"
            f"\n        on this machine no step is under {r['machine_bound_s']:.3f}s = floor x"
            f"{r['machine_bound_over_floor']:.2f} (the reference's CPU {r['reference_cpu_s_per_step']:.3f}s + the "
            f"bare bus's, over {r['cores']} cores): step/that {r['step_over_machine_bound']:.2f}"
            f"\n        Freivalds' check of every block: {r['verify_cpu_s_per_step']:.4f}s of PS CPU per step, "
            f"{r['verify_share_of_step']:.1%} of the step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--precision", nargs="+", default=["fp32"], choices=("fp32", "bf16", "fp16"))
    p.add_argument("--deferred", nargs="+", type=int, default=[0, 8],
                   help="deferred_gemms settings to run side by side (0: one GEMM at a time)")
    p.add_argument("--planner", choices=("uniform", "cost", "even"), default="uniform",
                   help="uniform: tiles of 256 from a queue (comparable with earlier figures); cost or even: the "
                        "scheduler's plan, as `cleave train` runs")
    p.add_argument("--chunks", type=int, default=None, help="with a planner: the scheduler's chunks (default: its own)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences a step (default: the job's own, 8)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    configure("bench", level="warning")
    results = [bench(preset, args.steps, args.workers, prec, deferred, args.planner, args.chunks, args.batch_size)
               for preset in args.presets
               for prec in args.precision for deferred in args.deferred]
    for r in results:
        print(report(r))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
