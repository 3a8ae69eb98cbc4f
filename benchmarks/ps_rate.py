"""The PS's byte rate: one large GEMM dealt by the PS's own dispatching code to N worker processes that
answer at once, against nats-server's rate with as many connections, measured in the same run.

A local nats-server, the scheduler (uniform tiles of `--tile` rows and columns) and N worker processes: the
real worker (`cleave worker`: its subscriptions, block cache, result encoding and upload), except that a
tile's product is not computed but read from the product computed once before the run (a file the workers
map; each block names its first row and column in its first element), so that the workers answer as
fast as their bytes arrive and the PS's hot path is what is measured. The PS is the dispatcher
(`cleave_ps.fleet.dispatcher.Dispatcher`, its result subscription and its plan watch) in this process,
dealing `--gemms` GEMMs of M x K by K x N float32, one after the other, every block fresh (no block is
cached by a worker from one GEMM to the next); each product is checked equal to the precomputed one
(between GEMMs; the CPU of that check, `product_check_cpu_s`, is not counted as the PS's).

Then, on the same nats-server, the bus's rate at the PS's message sizes (`floors.bus_measure`: N publisher/
subscriber process pairs, or one publisher to N subscribers, best of 2 tries each, per direction). The
figure is `ps_over_bus`: the seconds the bus needs for the bytes the PS moved (egress and ingress each at
its own rate) over the seconds the PS took; `egress_over_bus` compares the PS's egress alone with the bus's
rate at the egress message size (one direction at a time, while the PS sends and receives at once);
`ps_over_bus_both_ways`, the like-for-like figure, the seconds bare nats-py clients on the same topology (one
hub process and connection as the PS, N spoke processes as the workers: `floors.bus_mix_seconds`) take to move
the PS's egress and ingress at once, over the seconds the PS took: it is also the PS's egress rate over the bus's
egress rate when both carry the same ingress; `ps_cpu_over_bus_clients`, the PS's CPU seconds over those bare nats-py clients
spend on the same bytes (a publisher's per egress byte, subscribers' per ingress byte), which depends less on
what else the machine runs than the rates do; the workers' and nats-server's CPU over the same GEMMs
(`workers_cpu_s`, `nats_cpu_s`) against the spokes' in the bare run (`bus_both_ways_spokes_cpu_s`), as they
share the machine's cores with the PS. Where the PS's CPU goes: `floors.CpuSampler`, and with `--py-spy` a
py-spy profile of this process (`benchmarks/results/ps_rate.speedscope.json`).
Writes benchmarks/results/ps_rate.json.

    nice -n 10 .venv/bin/python benchmarks/ps_rate.py [--workers 4] [--m 4096 --n 4096 --k 1024]
                                                      [--tile 1024] [--gemms 6] [--py-spy]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import floors
import numpy as np
import torch

from cleave import bus as busmod
from cleave.api.fleet import LocalFleet
from cleave.runtime.logs import configure
from cleave.schemas import SUBJECT_RESULTS, TileResult
from cleave_ps.fleet.dispatcher import Dispatcher
from cleave_ps.fleet.plans import PlanWatch
from cleave_ps.settings import PsSettings

RESULTS = Path(__file__).parent / "results" / "ps_rate.json"
READY_TIMEOUT_S = 90.0
WORKER_CACHE_BYTES = 256 << 20  # a worker keeps every block one GEMM sends it

# The real worker, its tile's product read from the precomputed one instead of computed.
WORKER = """
import os, sys, time
import numpy as np, torch
from cleave import codec
from cleave.schemas import TileResult
import cleave_worker.tiles as tiles
product = np.load(os.environ["PS_RATE_PRODUCT"], mmap_mode="r")
def answer(task, a, bt, worker_id, corrupt=0.0):
    start = time.perf_counter()
    r0, c0 = int(a[0, 0]), int(bt[0, 0])
    out = torch.from_numpy(np.array(product[r0 : r0 + a.shape[0], c0 : c0 + bt.shape[0]]))
    return TileResult(job=task.job, epoch=task.epoch, step=task.step, op=task.op, gemm=task.gemm, tile=task.tile,
                      attempt=task.attempt, worker_id=worker_id, out=codec.tensor_view(out),
                      compute_s=time.perf_counter() - start)
tiles.compute = answer
from cleave_cli.main import main
sys.exit(main(["worker", *sys.argv[1:]]))
"""


def inputs(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random A (m x k) and Bᵀ (n x k) whose first column holds each row's index (exact in float32), so that
    a block names where it starts."""
    g = torch.Generator().manual_seed(seed)
    a, bt = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    a[:, 0] = torch.arange(m, dtype=torch.float32)
    bt[:, 0] = torch.arange(n, dtype=torch.float32)
    return a, bt


def save_product(truth: torch.Tensor, run_dir: Path) -> Path:
    """The product where the workers map it from (shared memory when there is some)."""
    path = Path("/dev/shm" if Path("/dev/shm").is_dir() else run_dir) / f"ps_rate-{os.getpid()}.npy"
    np.save(path, truth.numpy())
    return path


class Wire:
    """The message sizes the PS puts on and takes off the bus, observed by wrapping its own Bus object."""

    def __init__(self, bus: busmod.Bus) -> None:
        self.down: Counter = Counter()  # message size -> bytes moved in messages of that size
        self.up: Counter = Counter()
        self.on = False
        publish = bus.publish_pieces  # what publish_frame calls too
        cap = bus.max_payload

        async def publish_pieces(subject: str, pieces: list, **kw) -> int:  # noqa: ANN003
            if self.on:
                size = sum(len(p) for p in pieces)
                for start in range(0, size, cap):  # as codec.split cuts it (to within its header)
                    part = min(cap, size - start)
                    self.down[part] += part
            return await publish(subject, pieces, **kw)

        bus.publish_pieces = publish_pieces

    def seen(self, nbytes: int, cap: int) -> None:
        if self.on:
            for start in range(0, nbytes, cap):
                part = min(cap, nbytes - start)
                self.up[part] += part


def weighted_median(sizes: Counter) -> int:
    """The message size below and above which half the bytes travel."""
    total, acc = sum(sizes.values()), 0
    for size in sorted(sizes):
        acc += sizes[size]
        if acc * 2 >= total:
            return size
    return 0


@contextlib.contextmanager
def py_spy(out: Path, enabled: bool):
    """py-spy recording this process (all threads, idle excluded) while the body runs, when asked and installed."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not enabled or not Path(exe).exists():
        yield None
        return
    proc = subprocess.Popen([exe, "record", "--pid", str(os.getpid()), "--rate", "200", "--format", "speedscope",
                             "--output", str(out), "--threads", "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # attached
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)


# Where the PS's time goes in a py-spy profile: a sample is put in the first group that one of its frames
# (innermost first) belongs to, by (file ending, function name prefix); a sample whose innermost frame waits
# (IDLE), and the benchmark's own CPU sampler, are left out.
# left out of the split: waiting, and this benchmark's own check of each product (torch.equal, under `measure`)
IDLE = (("threading.py", "Condition.wait"), ("threading.py", "Event.wait"), ("selectors.py", "EpollSelector.select"),
        ("futures/thread.py", "_worker"), ("queue.py", ""), ("ps_rate.py", "measure"))
PROFILE_GROUPS = (
    ("idle", (("floors.py", "CpuSampler"),)),
    ("encode: tensor bytes copied", (("cleave/codec.py", "tensor_to_data"),)),
    ("encode: msgpack", (("msgpack/__init__.py", ""), ("cleave/codec.py", "encode"))),
    ("encode: chunks copied", (("cleave/codec.py", "split"),)),  # split and split_pieces
    ("publish: nats-py PUB framing copy", (("protocol/command.py", "pub_cmd"), ("aio/client.py", "Client._send_command"))),
    ("publish: join and socket write", (("cleave/bus/direct.py", "put"), ("cleave/bus/send.py", ""),
                                        ("asyncio/transports.py", "WriteTransport.writelines"),
                                        ("asyncio/selector_events.py", "_SelectorSocketTransport.write"),
                                        ("asyncio/selector_events.py", "_SelectorSocketTransport._write_ready"))),
    ("receive: socket read", (("asyncio/selector_events.py", "_SelectorSocketTransport._read_ready"),
                              ("asyncio/streams.py", "StreamReader"), ("aio/transport.py", "TcpTransport.read"))),
    ("receive: parser", (("cleave/bus/receive.py", ""), ("protocol/parser.py", ""), ("aio/client.py", "Client._build_message"))),
    ("receive: reassembly", (("cleave/codec.py", "Reassembler"),)),
    ("decode: zstd", (("cleave/codec.py", "_decompress"),)),
    ("decode: msgpack and schema", (("cleave/codec.py", ""), ("/pydantic", ""))),
    ("assembly and checks", (("fleet/dispatcher.py", "Dispatcher._accept.<locals>"), ("fleet/frames.py", "finite"),
                             ("fleet/frames.py", "block"))),
    ("thread hand-offs", (("asyncio/threads.py", ""), ("futures/thread.py", "ThreadPoolExecutor.submit"),
                          ("asyncio/base_events.py", "BaseEventLoop.run_in_executor"),
                          ("asyncio/selector_events.py", "BaseSelectorEventLoop._write_to_self"))),
)


def profile_split(path: Path) -> dict[str, float]:
    """The seconds of a py-spy speedscope profile in each of PROFILE_GROUPS ("dispatcher, dealer, event loop":
    the rest), idle left out."""
    d = json.loads(path.read_text())
    frames = d["shared"]["frames"]
    out: Counter = Counter()
    for prof in d["profiles"]:
        for stack, w in zip(prof["samples"], prof["weights"], strict=True):
            leaf = frames[stack[-1]] if stack else {"name": "", "file": "threading.py"}
            if any(leaf.get("file", "").endswith(end) and leaf["name"].startswith(fn) for end, fn in IDLE):
                continue
            group = "dispatcher, dealer, event loop"
            for i in reversed(stack):
                f = frames[i]
                hit = next((g for g, keys in PROFILE_GROUPS for end, fn in keys
                            if f.get("file", "").endswith(end) and f["name"].startswith(fn)), None)
                if hit:
                    group = hit
                    break
            out[group] += w
    out.pop("idle", None)
    return dict(out.most_common())


async def measure(args: argparse.Namespace, run_dir: Path) -> dict:
    m, n, k, workers = args.m, args.n, args.k, args.workers
    a, bt = inputs(m, n, k)
    truth = a @ bt.T
    product = save_product(truth, run_dir)
    fleet = LocalFleet(run_dir, 0, scheduler_env={
        "CLEAVE_SCHEDULER_PLANNER": "uniform",
        "CLEAVE_SCHEDULER_TILE_ROWS": str(args.tile), "CLEAVE_SCHEDULER_TILE_COLS": str(args.tile),
    })
    try:
        fleet.start()
        url = fleet.stack.nats_url
        env = {"PS_RATE_PRODUCT": str(product), "CLEAVE_WORKER_CACHE_BYTES": str(WORKER_CACHE_BYTES),
               "CLEAVE_WORKER_MEMORY_BYTES": str(1 << 30)}
        for i in range(workers):
            fleet.stack.spawn(f"worker-{i + 1}", "worker", [sys.executable, "-c", WORKER, "--nats", url,
                                                           "--worker-id", f"rate-w{i + 1}"], env)
        fleet.wait_joined()
        bus = await busmod.connect(url, "cleave-ps-rate")
        await bus.setup()
        wire = Wire(bus)
        settings = PsSettings(nats_url=url, max_result_bytes=max(64 << 20, 2 * args.tile * args.tile * 4))
        job, epoch, stop = "ps-rate", time.time_ns(), asyncio.Event()
        d = Dispatcher(bus, job, epoch, settings)

        async def on_result(msg: TileResult, nbytes: int) -> None:
            wire.seen(nbytes, bus.max_payload)
            await d.on_result(msg, nbytes)

        sub = await bus.subscribe(SUBJECT_RESULTS.format(job=job, epoch=epoch, worker_id="*"), TileResult, on_result,
                                  max_bytes=settings.max_result_bytes, sender="worker_id", compressed=False)
        watch = asyncio.create_task(PlanWatch(bus, on_plan=d.set_plan).follow(stop))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len([w for w, mb in d.workers.items() if mb.proven]) < workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(d.workers)} of {workers} workers in the plan")
            await asyncio.sleep(0.1)
        print(f"{workers} workers in the plan", file=sys.stderr, flush=True)
        # two warm-up GEMMs, the first's output held while the second runs, as the loop holds each output while
        # the next GEMM runs: every measured GEMM's output then reuses a buffer of the PS's pool, as in a PS's
        # steady state (a fresh 64 MiB output costs its page faults: 0.4-0.8 s on this VM, `products`)
        held = []
        for _ in range(2):
            d.new_step()
            held.append(await d.gemm(a, bt, 0, 1, "warm-up"))
            assert torch.equal(held[-1], truth), "the warm-up product differs"
        del held
        sampler = floors.CpuSampler()
        sampler.start()
        others = {p.name: (p.role, p.popen.pid) for p in fleet.stack.procs.values() if p.popen is not None}
        others0 = {name: floors.cpu_s(pid) for name, (_, pid) in others.items()}
        down0, up0, verify0, walls, checked_s = d.c.bytes_down, d.c.bytes_up, d.c.verify_cpu_s, [], 0.0
        fresh0 = d.products.fresh
        wire.on = True
        t0 = time.time()
        with py_spy(RESULTS.with_suffix(".speedscope.json"), args.py_spy):
            for g in range(args.gemms):
                d.new_step()  # fresh block ids: every GEMM sends its inputs again
                s0 = time.perf_counter()
                out = await d.gemm(a, bt, g + 1, 1, "bench")
                walls.append(time.perf_counter() - s0)
                c0 = time.process_time()  # (the benchmark's own check, between GEMMs: not the PS's CPU)
                assert torch.equal(out, truth), f"GEMM {g} differs from the product"
                checked_s += time.process_time() - c0
        t1 = time.time()
        wire.on = False
        fresh_outputs = d.products.fresh - fresh0
        print(f"PS: {args.gemms} GEMMs in {sum(walls):.2f}s ({[round(w, 2) for w in walls]}; outputs in fresh memory: "
              f"{fresh_outputs})", file=sys.stderr, flush=True)
        sampler.stop()
        down, up, verify_s = d.c.bytes_down - down0, d.c.bytes_up - up0, d.c.verify_cpu_s - verify0
        spent = Counter()  # the other processes' CPU seconds over the same GEMMs, by role
        for name, (role, pid) in others.items():
            spent[role] += floors.cpu_s(pid) - others0[name]
        print(f"  over those GEMMs the {workers} workers' CPU {spent['worker']:.2f}s, nats-server's "
              f"{spent['nats']:.2f}s", file=sys.stderr, flush=True)
        cpu = sampler.between(t0, t1)
        cpu["cpu_s"] -= checked_s
        cpu["python"] = max(0.0, cpu["python"] - checked_s)  # (where the sampler put it: ps_rate.py's frame)
        stop.set()
        d.stopping = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(watch, 5)
        await sub.unsubscribe()
        await bus.close()
        size_down, size_up = weighted_median(wire.down), weighted_median(wire.up)
        bus_down = {one: await floors.bus_best(url, workers, size_down, one) for one in (False, True)}
        bus_up = {one: await floors.bus_best(url, workers, size_up, one) for one in (False, True)}
        mix = min([await floors.bus_mix_seconds(url, workers, size_down, down, size_up, up) for _ in range(2)],
                  key=lambda r: r["seconds"])
    finally:
        fleet.stop()
        product.unlink(missing_ok=True)
    wall = sum(walls)
    rate_down, rate_up = (max(r["bytes_per_s"] for r in rates.values()) for rates in (bus_down, bus_up))
    bus_s = down / rate_down + up / rate_up
    # the CPU a bare nats-py client spends on these bytes: one publisher's for the egress, subscribers' for the ingress
    clients_s = (bus_down[True]["publisher_ns_per_byte"] * down + bus_up[True]["subscriber_ns_per_byte"] * up) / 1e9
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other developers' processes "
                   "(absolute rates vary run to run; the ratios are the figures)",
        "load_average_1min_at_end": os.getloadavg()[0],
        "m": m, "n": n, "k": k, "tile": args.tile, "dtype": "float32", "gemms": args.gemms, "workers": workers,
        "connections": workers + 1, "max_payload": fleet.stack.max_payload - busmod.HEADROOM,
        "ps_seconds": wall, "gemm_seconds": walls, "fresh_outputs": fresh_outputs,
        "workers_cpu_s": spent["worker"], "nats_cpu_s": spent["nats"],
        "ps_bytes_down": down, "ps_bytes_up": up,
        "ps_egress_bytes_per_s": down / wall, "ps_ingress_bytes_per_s": up / wall,
        "ps_bytes_per_s": (down + up) / wall,
        "msg_bytes_down": size_down, "msg_bytes_up": size_up,
        "msg_sizes_down": {str(s): b for s, b in sorted(wire.down.items())},
        "msg_sizes_up": {str(s): b for s, b in sorted(wire.up.items())},
        "bus_bytes_per_s": (down + up) / bus_s, "bus_bytes_per_s_down": rate_down, "bus_bytes_per_s_up": rate_up,
        "bus_one_publisher_bytes_per_s_down": bus_down[True]["bytes_per_s"],
        "bus_pairs_bytes_per_s_down": bus_down[False]["bytes_per_s"],
        "bus_one_publisher_bytes_per_s_up": bus_up[True]["bytes_per_s"], "bus_pairs_bytes_per_s_up": bus_up[False]["bytes_per_s"],
        "bus_publisher_ns_per_byte": bus_down[True]["publisher_ns_per_byte"],
        "bus_subscriber_ns_per_byte": bus_up[True]["subscriber_ns_per_byte"],
        "bus_clients_cpu_s_for_ps_bytes": clients_s, "ps_cpu_over_bus_clients": cpu["cpu_s"] / clients_s,
        "bus_seconds_for_ps_bytes": bus_s,
        "ps_over_bus": bus_s / wall, "egress_over_bus": down / wall / rate_down,
        "bus_both_ways_seconds": mix["seconds"], "bus_both_ways_hub_cpu_s": mix["hub_cpu_s"],
        "bus_both_ways_spokes_cpu_s": mix["spokes_cpu_s"],
        "ps_over_bus_both_ways": mix["seconds"] / wall,
        "ps_cpu_s": cpu["cpu_s"], "product_check_cpu_s": checked_s, "ps_verify_cpu_s": verify_s, "ps_cpu_split_s": {c: cpu[c] for c in floors.CATEGORIES},
        "ps_cpu_per_byte_ns": 1e9 * cpu["cpu_s"] / (down + up),
    }


def with_profile(r: dict, path: Path) -> dict:
    if path.exists():
        split = profile_split(path)
        busy = sum(split.values())
        r["py_spy_busy_s"] = busy
        r["py_spy_share"] = {g: s / busy for g, s in split.items()}
    return r


def report(r: dict) -> str:
    split = ", ".join(f"{k} {v:.2f}s" for k, v in r["ps_cpu_split_s"].items())
    return (f"{r['gemms']} GEMMs {r['m']}x{r['k']} . {r['k']}x{r['n']} fp32, tiles {r['tile']}, {r['workers']} workers: "
            f"PS egress {r['ps_egress_bytes_per_s'] / 1e6:.0f} MB/s, ingress {r['ps_ingress_bytes_per_s'] / 1e6:.0f} MB/s "
            f"(messages of {r['msg_bytes_down'] / 2**20:.1f}/{r['msg_bytes_up'] / 2**20:.1f} MiB); bus "
            f"{r['bus_bytes_per_s_down'] / 1e6:.0f}/{r['bus_bytes_per_s_up'] / 1e6:.0f} MB/s down/up with "
            f"{r['connections']} connections -> PS/bus {r['ps_over_bus']:.2f}, egress/bus {r['egress_over_bus']:.2f}; "
            f"bus both ways at once {r['bus_both_ways_seconds']:.2f}s for the PS's bytes (hub CPU "
            f"{r['bus_both_ways_hub_cpu_s']:.2f}s, spokes' {r['bus_both_ways_spokes_cpu_s']:.2f}s) -> PS/bus both ways "
            f"{r['ps_over_bus_both_ways']:.2f}; the workers' CPU {r['workers_cpu_s']:.2f}s, nats-server's "
            f"{r['nats_cpu_s']:.2f}s"
            f"\n  PS CPU {r['ps_cpu_s']:.2f}s (Freivalds' checks {r['ps_verify_cpu_s']:.2f}s) over {r['ps_seconds']:.2f}s ({r['ps_cpu_per_byte_ns']:.2f} ns a byte; "
            f"bare nats-py clients {r['bus_clients_cpu_s_for_ps_bytes']:.2f}s for the same bytes, publisher "
            f"{r['bus_publisher_ns_per_byte']:.2f} and subscribers {r['bus_subscriber_ns_per_byte']:.2f} ns a byte "
            f"-> x{r['ps_cpu_over_bus_clients']:.1f}): {split}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--tile", type=int, default=1024, help="the scheduler's tile rows and columns")
    p.add_argument("--gemms", type=int, default=6)
    p.add_argument("--py-spy", action="store_true", help="also record a py-spy profile of the PS (if installed)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    configure("bench", level="warning")
    with tempfile.TemporaryDirectory() as tmp:
        r = asyncio.run(measure(args, Path(tmp)))
    spy = RESULTS.with_suffix(".speedscope.json")
    if args.py_spy:
        r = with_profile(r, spy)
    print(report(r))
    for group, share in r.get("py_spy_share", {}).items():
        print(f"  {share:6.1%} {group}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
